"""tools/benchmark.py's arguments and inputs: everything wrong is refused in
one line before any run starts, and failed runs make the tool fail."""
import json
import os.path as osp

import pytest
import torch

from mmdtr.errors import MmdtrError

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
RESNET = osp.join(REPO, 'configs', 'resnet50_synthetic.py')

BAD_ARGUMENTS = [
    ('all', 'needs --capacity'),
    ('largest-batch --capacity lots', 'is not a size'),
    ('largest-batch --capacity 1GB --headroom 2GB', 'leaves no room'),
    ('compare --match magic', 'neither a technique'),
    ('sweep --thresholds 1XB', 'is not a size'),
    ('sweep --repeats 0', 'must be at least 1'),
    ('largest-batch --capacity 0', '--capacity 0 must be above 0'),
    ('largest-batch --capacity 1GB --max-batch 64 --start-batch 65',
     '--start-batch 65 is above the largest batch tried, 64'),
    ('all --quick --start-batch 8', 'as --quick sets it'),
    ('sweep --device cpu --thresholds 0', 'threshold of 0'),
    ('compare --device cpu --match 0B', 'threshold of 0'),
    (f'sweep --seed {2**64}', 'out of the range'),
    # flags a command does not use were not read (an adversarial search)
    ('sweep --capacity foo', '--capacity=.foo. is not a size'),
    ('sweep --headroom foo', '--headroom=.foo. is not a size'),
    ('sweep --match magic', 'neither a technique'),
    ('largest-batch --capacity 1GB --start-batch 2000',
     r'largest batch tried, 1024 \(--max-batch\)\.'),
]
BAD_ARGUMENTS += [(f'sweep --fractions 0.5 {v}',
                   fr'--fractions {v} .* \(0, 1\]')
                  for v in ('-1', '0', '2', 'inf', 'nan')]
TOO_LOW = ('--batch-size 0', '--steps 0', '--warmup -1', '--threads -1',
           '--image-size 0', '--seq-len 0', '--max-batch 0', '--start-batch 0')
BAD_ARGUMENTS += [(f'sweep {v}', f'{v} must be at least') for v in TOO_LOW]
BAD_ARGUMENTS += [(f'sweep --timeout {v}', f'--timeout {v} is not accepted')
                  for v in ('0', '-1', 'inf', '3000000')]
BAD_ARGUMENTS += [(f'sweep --device {v}', f"--device '{v}' is not accepted")
                  for v in ('foo', 'mps', 'CPU', 'cuda:x')]


@pytest.mark.parametrize('argv, match', BAD_ARGUMENTS)
def test_bad_arguments_fail_before_any_run(tool, tmp_path, argv, match):
    args = tool.parse_args([RESNET] + argv.split() +
                           ['--work-dir', str(tmp_path)])
    with pytest.raises(MmdtrError, match=match):
        tool.check_args(args)


def test_good_arguments_pass(tool):
    args = tool.parse_args([RESNET, 'sweep', '--fractions', '1', '0.5'])
    tool.check_args(args)  # --fractions 1: DTR at the peak
    args = tool.parse_args([RESNET, 'sweep', '--device', 'cpu:0'])
    tool.check_args(args)
    assert args.device == 'cpu'


@pytest.mark.skipif(torch.cuda.is_available(), reason='needs a CPU-only box')
def test_cuda_device_without_cuda_fails(tool):
    args = tool.parse_args([RESNET, 'sweep', '--device', 'cuda'])
    with pytest.raises(MmdtrError, match='CUDA is not available'):
        tool.check_args(args)


def test_empty_work_dir_is_refused_not_replaced(tool, tmp_path, monkeypatch):
    # '' was replaced by the default work dir (an adversarial search)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MmdtrError, match="--work-dir '' is not"):
        tool.main([RESNET, 'sweep', '--quick', '--work-dir', ''])
    assert not (tmp_path / 'work_dirs').exists()


def test_report_needs_results(tool, tmp_path):
    with pytest.raises(MmdtrError, match='no .*results.json'):
        tool.main([RESNET, 'report', '--work-dir', str(tmp_path)])


@pytest.fixture
def canned(tool, monkeypatch, canned_launcher):
    """``canned(**answer)``: the tool's runs answered by a
    ``CannedLauncher`` (see conftest.py), which it returns."""

    def make(**answer):
        launcher = canned_launcher(**answer)
        monkeypatch.setattr(tool, 'Launcher', lambda *args: launcher)
        return launcher

    return make


QUIET = ['--no-prime', '--no-progress']

BAD_INPUT = [
    (config, argv, None, match, 'sweep') for config, argv, match in (
        ('/nonexistent.py', [], 'does not exist'),
        ('x = 1', [], 'has no model dict'),
        ('model = dict(type="A")\n'
         'train_dataloader = dict(dataset=dict())', [],
         'batch_size=None .* not a positive int'),
        (RESNET, ['--cfg-options', 'model.depth'], 'KEY=VALUE'),
        (RESNET, ['--cfg-options', 'model.depth.x=1'], 'cannot be merged'),
        # ignored, or failing in every run, before (an adversarial search)
        (RESNET, ['--cfg-options', 'dtr.eviction_threshold=3XB'],
         r"on \['dtr'\] would be ignored"),
        (RESNET, ['--cfg-options', 'optim_wrapper.accumulative_counts=2'],
         r"on \['optim_wrapper'\] would be ignored"),
        (RESNET, ['--cfg-options', 'model.depth=abc'],
         'ResNet depth must be one of'),
        (RESNET, ['--cfg-options', 'model.type=ResNet50Classifer'],
         'model of the config cannot be built: KeyError'),
    )
]
# the alternatives' blocks: their runs failed after the baseline's (and a
# glob given to sweep, which does not use it, was ignored)
BAD_INPUT += [(RESNET, ['--blocks', 'nomatch*'] + extra, None,
               "--blocks: no sub-module .* matches 'nomatch\\*'", command)
              for command, extra in (('compare', []),
                                     ('all', ['--capacity', '1GB']), ('sweep',
                                                                      []))]
BAD_INPUT += [(RESNET, [], results, match, command) for results, match in (
    ('{"meta": {}, "sweep": ', 'cannot be read as JSON'),
    ('{"sweep": {"runs": []}}', 'sweep.settings is not an obj'),
    ('{"foo": 1}', r"has keys \['foo'\]"),
) for command in ('sweep', 'report')]


@pytest.mark.parametrize('config, argv, results, match, command', BAD_INPUT)
def test_bad_input_fails_before_any_run(tool, tmp_path, canned, config, argv,
                                        results, match, command):
    if not config.startswith('/'):  # the text of a config
        (tmp_path / 'c.py').write_text(config)
        config = str(tmp_path / 'c.py')
    if results is not None:
        (tmp_path / 'results.json').write_text(results)
    launcher = canned()
    with pytest.raises(MmdtrError, match=match):
        tool.main([config, command, '--work-dir',
                   str(tmp_path)] + argv + QUIET)
    assert launcher.calls == []
    assert not (tmp_path / 'logs').exists()
    assert not (tmp_path / 'benchmark.md').exists()


def test_quick_sweep_with_thresholds_runs_no_fractions(tool, tmp_path, canned):
    # --quick's fractions ran too, against the help (an adversarial search)
    launcher = canned()
    tool.main([
        RESNET, 'sweep', '--quick', '--thresholds', '10MB', '--work-dir',
        str(tmp_path)
    ] + QUIET)
    dtr_runs = [name for name in launcher.calls if name.startswith('dtr')]
    assert len(dtr_runs) == 2 and not any('@0.' in n for n in dtr_runs), \
        launcher.calls


def test_failed_runs_exit_non_zero(tool, tmp_path, canned):
    argv = [
        RESNET, 'all', '--capacity', '1GB', '--fractions', '0.5', '--work-dir',
        str(tmp_path)
    ]
    with pytest.raises(
            MmdtrError,
            match='3 of 3 runs failed: baseline '
            r'\(error\).*so compare, largest-batch did not run'):
        canned(status='error', peak_engine=None)
        tool.main(argv + QUIET)
    with open(tmp_path / 'results.json') as f:
        assert [r['status'] for r in json.load(f)['sweep']['runs']
                ] == ['error', 'error', 'error', 'skipped']


def test_quick_headroom_is_checked_once_the_capacity_is_known(
        tool, tmp_path, canned):
    argv = [
        RESNET, 'all', '--quick', '--headroom', '2KB', '--work-dir',
        str(tmp_path)
    ]  # the capacity is 1.25 * 1000 bytes
    launcher = canned()
    with pytest.raises(MmdtrError, match='leaves no room in the capacity'):
        tool.main(argv + QUIET)
    assert launcher.calls == ['baseline']


@pytest.mark.fails_before_torch(
    (2, 6),
    reason='PyTorch 2.4 and 2.5 print a DeprecationWarning of their '
    'own (mmengine imports torch.distributed.optim) before the error line')
def test_bad_argument_is_one_line(tmp_path, benchmark_cli):
    proc = benchmark_cli('sweep', '--steps', '0', '--work-dir', str(tmp_path))
    assert proc.returncode == 1
    assert proc.stderr == ('MmdtrError: mmdtr: --steps 0 must be at least 1. '
                           'Hint: give --steps 1 or more, or leave it out '
                           'for its default.\n')


def test_work_dir_under_a_file_is_refused(tool, tmp_path, canned):
    # a NotADirectoryError traceback from the launcher's makedirs
    (tmp_path / 'f').write_text('')
    launcher = canned()
    with pytest.raises(MmdtrError, match='must be a directory'):
        tool.main([
            RESNET, 'sweep', '--work-dir',
            str(tmp_path / 'f' / 'sub'), '--no-prime', '--no-progress'
        ])
    assert launcher.calls == []
