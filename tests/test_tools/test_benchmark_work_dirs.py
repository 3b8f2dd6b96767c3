"""The benchmark's work dir reused and written (found by an adversarial
search of the tool): an earlier invocation's logs and machine kept, the
engine a figure came from recorded, and what cannot be written said in one
line."""
import json
import re

import pytest

import mmdtr
from mmdtr.benchmarking import Launcher
from mmdtr.benchmarking.report import markdown
from mmdtr.benchmarking.results_updates import machine_info
from mmdtr.errors import MmdtrError
from .conftest import RESNET


def test_logs_are_numbered_on_from_an_earlier_invocation(tmp_path):
    # a second command restarted at 001 and overwrote the log the first
    # one's section of results.json names
    for name in ('001_baseline.log', '002_dtr_0.5.log', 'notes.txt'):
        (tmp_path / name).write_text('')
    assert Launcher('subprocess', str(tmp_path)).count == 2
    assert Launcher('subprocess', str(tmp_path / 'new')).count == 0


def test_machine_names_the_engine_it_measured():
    # results.json recorded no commit: nothing tied a figure to the engine
    source = machine_info('cpu')['mmdtr']
    assert source.startswith(mmdtr.__version__)
    if source != mmdtr.__version__:  # a git checkout
        assert re.fullmatch(r'\S+ \([0-9a-f]{7,}(\+dirty)?\)', source)


def _section(machine=None):
    section = dict(
        settings=dict(config=RESNET, batch_size=2, match='mmdtr_ac'), runs=[])
    if machine is not None:
        section['machine'] = machine
    return section


def test_a_section_of_another_invocation_keeps_its_machine():
    # a sweep then a compare into one work dir: the sweep stood under the
    # compare's machine line
    latest = dict(cpu='B', device='cpu', load_average=[1.0])
    table = markdown(
        dict(
            meta=latest,
            sweep=_section(dict(cpu='A', device='cuda', mmdtr='0.1.0 (x)')),
            compare=_section(latest)))
    sweep, compare = table.split('## Alternatives')
    assert 'Machine of this section: A (None CPUs)' in sweep
    assert 'mmdtr 0.1.0 (x), device cuda' in sweep
    assert 'Machine of this section' not in compare
    # JSONs written before sections had a machine show the top line only
    assert 'Machine of this section' not in markdown(
        dict(meta=latest, compare=_section()))


def test_a_work_dir_that_cannot_be_written_is_one_mmdtr_line(tool, tmp_path):
    # os.access passes for root, and a file named logs is in the way: a raw
    # FileExistsError traceback before
    work = tmp_path / 'bench'
    work.mkdir()
    (work / 'logs').write_text('')
    with pytest.raises(
            MmdtrError, match="cannot write '.*logs' in the work "
            'dir') as info:
        tool.main([RESNET, 'sweep', '--work-dir', str(work), '--no-prime'])
    assert 'you can write to' in info.value.hint
    assert not (work / 'results.json').exists()


def test_sections_written_by_one_invocation_carry_its_machine(
        tool, tmp_path, monkeypatch):
    work = tmp_path / 'bench'
    monkeypatch.setattr(
        tool, 'run_command', lambda command, *a:
        ('sweep', dict(settings=dict(config=RESNET, batch_size=2), runs=[])))
    tool.main([RESNET, 'sweep', '--work-dir', str(work), '--no-prime'])
    results = json.loads((work / 'results.json').read_text())
    assert results['sweep']['machine'] == results['meta']
