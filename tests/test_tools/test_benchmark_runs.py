"""tools/benchmark.py's runs: fresh interpreters for CUDA, repeats in
rounds, lost rounds and missing peaks, results done in the grace period,
the largest batch's probes, and how a killed run reads.

Nothing here asserts a timing.
"""
import os.path as osp
import signal

import pytest

from mmdtr.benchmarking import BenchmarkSuite, Launcher, launch, make_spec
from mmdtr.benchmarking.launch import default_launcher

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
RESNET = osp.join(REPO, 'configs', 'resnet50_synthetic.py')


def test_cuda_runs_get_a_fresh_interpreter_each():
    # a forked child cannot use CUDA once the server's imports touched it
    assert default_launcher('cuda') == default_launcher('cuda:1') == \
        'subprocess'
    assert default_launcher('cpu') in ('forkserver', 'subprocess')


def test_repeats_run_in_rounds_and_pool_the_steps(canned_launcher):
    launcher = canned_launcher()
    suite = BenchmarkSuite(
        launcher, False, 3, config=RESNET, batch_size=2, device='cpu')
    records = suite.sweep(fractions=(0.5, ))
    # rounds: every run once, then every run again in the opposite order,
    # ..., so that a steady drift of the machine's speed within a round
    # does not always fall on the baseline, which runs first
    assert launcher.calls == [
        'baseline', 'dispatch floor', 'dtr (no eviction)', 'dtr@0.5',
        'dtr@0.5 (repeat 2)', 'dtr (no eviction) (repeat 2)',
        'dispatch floor (repeat 2)', 'baseline (repeat 2)',
        'baseline (repeat 3)', 'dispatch floor (repeat 3)',
        'dtr (no eviction) (repeat 3)', 'dtr@0.5 (repeat 3)'
    ]
    baseline = records[0]
    assert baseline['step_times_s'] == [1.0, 8.0, 9.0]
    assert baseline['median_step_s'] == 8.0 and baseline['repeats'] == 3
    assert len(baseline['round_load_averages']) == 3


class _LosesRound2:
    """A canned launcher whose runs of the second round fail."""

    def __init__(self, canned):
        self.canned = canned
        self.calls = canned.calls

    def run(self, spec, name='run'):
        result = self.canned.run(spec, name)
        if '(repeat 2)' in name:
            result.update(status='error', error='lost')
        return result


def test_a_lost_round_is_not_counted_as_pooled(canned_launcher):
    # repeats read 3 with two rounds pooled, and the kept counts were
    # misaligned (found by a review)
    suite = BenchmarkSuite(
        _LosesRound2(canned_launcher(evictions=1.0)),
        False,
        3,
        config=RESNET,
        batch_size=2,
        device='cpu')
    baseline = suite.sweep(fractions=(0.5, ))[0]
    assert baseline['repeats'] == 2 and baseline['lost_repeats'] == 1
    assert len(baseline['step_times_s']) == 2
    assert len(baseline['round_load_averages']) == 2


def test_no_peak_says_what_happened(canned_launcher):
    suite = BenchmarkSuite(
        canned_launcher(peak_engine=None),
        False,
        config=RESNET,
        batch_size=2,
        device='cpu')
    error = suite.sweep(fractions=(0.5, ))[3]['error']
    assert 'failed' not in error
    assert error.endswith('dtr (no eviction) metered None bytes')


def test_a_run_done_in_the_grace_period_keeps_its_result(tmp_path):
    launcher = Launcher('forkserver', str(tmp_path))
    spec = dict(make_spec(RESNET, 'baseline', 1), config='missing.py')
    assert launcher.run(spec)['status'] == 'error'  # starts the server
    launcher.timeout = 1e-6  # over before the child has sent its result
    result = launcher.run(spec)
    assert result['status'] == 'error', result  # was 'killed', exit code 0
    assert 'missing.py' in result['error']


@pytest.mark.parametrize('device', ['cpu', 'cuda'])
def test_largest_batch_settings_are_the_probes(tool, monkeypatch, device):
    # they showed the config's batch, warm-up and steps, which no probe
    # used (found by a review)
    args = tool.parse_args([RESNET, 'largest-batch', '--capacity', '1GB'])
    suite = BenchmarkSuite(
        Launcher('subprocess', '.'), progress=False, device=device)
    specs = {}
    monkeypatch.setattr(suite, 'largest_batch', lambda *a: {})
    monkeypatch.setattr(
        suite, 'spec', lambda technique, **kw: specs.setdefault(technique, kw))
    monkeypatch.setattr(
        suite, 'run',
        lambda name, spec, bar: dict(status='oom', peak_engine=None))
    _, section = tool.run_command('largest-batch', args, suite)
    settings = section['settings']
    assert not {'batch_size', 'warmup', 'steps'} & set(settings)
    for technique in ('baseline', 'dtr'):
        suite.probe(technique, 4, 2**30, 'dtr', None)
        probe = specs[technique]
        assert settings['probe_steps'][technique] == dict(
            warmup=probe['warmup'], steps=probe['steps'])


@pytest.mark.parametrize('sig, status', [('SIGKILL', 'killed'),
                                         ('SIGTERM', 'killed'),
                                         ('SIGSEGV', 'crashed'),
                                         ('SIGABRT', 'crashed')])
def test_only_an_oom_killers_signal_reads_as_killed(tmp_path, monkeypatch, sig,
                                                    status):
    # any death without a result read as 'killed', which the largest-batch
    # search takes for "does not fit": a segfault made it report a smaller
    # batch (found by a review). A worker of its own that dies so
    (tmp_path / 'dying_worker.py'
     ).write_text(f'import os, signal\nos.kill(os.getpid(), signal.{sig})\n')
    monkeypatch.setenv('PYTHONPATH', str(tmp_path))
    monkeypatch.setattr(launch, '_WORKER', 'dying_worker')
    result = Launcher('subprocess',
                      str(tmp_path)).run(make_spec(RESNET, 'baseline', 1))
    assert result['status'] == status, result
    # the forked launcher reads the child's exit code the same way
    died = Launcher('forkserver', '.')._died(-getattr(signal, sig))
    assert died == {k: v for k, v in result.items() if k != 'log'}
