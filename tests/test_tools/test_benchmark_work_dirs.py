"""The benchmark's work dir reused and written (found by an adversarial
search of the tool): an earlier invocation's logs and machine kept, the
engine a figure came from recorded, and what cannot be written said in one
line."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import mmdtr
from mmdtr.benchmarking import Launcher
from mmdtr.benchmarking.report import markdown
from mmdtr.benchmarking.results_updates import machine_info
from mmdtr.errors import MmdtrError
from .conftest import REPO, RESNET, TOOL


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


def _alive_in_group(pgid: int) -> list:
    """The processes of group ``pgid`` that are not zombies."""
    alive = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != 'Z':
            alive.append(int(pid))
    return alive


@pytest.mark.skipif(not os.path.isdir('/proc/self'), reason='reads /proc')
def test_sigterm_stops_the_run_in_progress(tmp_path):
    # killed at once, the tool left its run and the fork server running
    # (found by an adversarial search)
    work = tmp_path / 'bench'
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([REPO, env.get('PYTHONPATH', '')])
    tool = subprocess.Popen([
        sys.executable, TOOL, RESNET, 'sweep', '--batch-size', '2',
        '--image-size', '32', '--steps', '200', '--cfg-options',
        'model.depth=18', '--work-dir',
        str(work), '--no-prime', '--no-progress'
    ],
                            env=env,
                            start_new_session=True,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(work.glob('logs/*.log')):  # a run has started
            assert tool.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        time.sleep(2)
        tool.send_signal(signal.SIGTERM)  # the tool alone, not its group
        assert tool.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while _alive_in_group(tool.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _alive_in_group(tool.pid) == []
    finally:
        for pid in _alive_in_group(tool.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_config_read_in_the_work_dir_is_not_a_write_error(tool, tmp_path):
    # a missing _base_ next to a config kept in the work dir was reported
    # as "cannot write ... in the work dir" (a review); and a work dir whose
    # path is a prefix of the config's directory, /tmp/w of /tmp/wd
    (tmp_path / 'wd').mkdir()
    config = tmp_path / 'wd' / 'cfg.py'
    config.write_text("_base_ = ['./missing_base.py']\n")
    for work in (tmp_path / 'wd', tmp_path / 'w'):
        with pytest.raises(Exception) as info:
            tool.main([str(config), 'sweep', '--work-dir', str(work)])
        assert 'cannot write' not in str(info.value)


def test_none_ran_counts_runs_that_lost_a_repeat_as_run():
    # a sweep whose every run lost a repeat stopped the commands after it,
    # "2 of 2 runs failed" (a review)
    from mmdtr.benchmarking.results_updates import failed_runs, none_ran
    runs = [
        dict(name=n, status='ok', lost_repeats=1) for n in ('baseline', 'x')
    ]
    assert len(failed_runs('sweep', dict(runs=runs))[0]) == 2
    assert not none_ran('sweep', dict(runs=runs))
    runs = [
        dict(name='baseline', status='error'),
        dict(name='x', status='skipped')
    ]
    assert none_ran('sweep', dict(runs=runs))
    assert not none_ran('sweep', dict(runs=runs[1:]))  # nothing ran


def test_results_are_written_whole(tmp_path, monkeypatch):
    # written in place, a signal while dumping left a cut file, which the
    # next command refused (a review): written aside, then moved over
    from mmdtr.benchmarking import results_updates
    path = tmp_path / 'results.json'
    results_updates.update_results(
        str(path), {}, 'sweep', dict(settings={}, runs=[]))

    def cut(obj, f, **kwargs):
        f.write('{"meta": {')
        raise KeyboardInterrupt

    monkeypatch.setattr(results_updates.json, 'dump', cut)
    with pytest.raises(KeyboardInterrupt):
        results_updates.update_results(
            str(path), {}, 'compare', dict(settings={}, runs=[]))
    assert json.loads(path.read_text())['sweep'] == dict(settings={}, runs=[])
