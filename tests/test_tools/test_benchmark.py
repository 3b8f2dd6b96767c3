"""tools/benchmark.py: output format of --quick, and the helpers behind it.

Nothing here asserts a timing: the runs are too small and the machines too
different. The end-to-end test checks what is written (JSON keys, table
rows, PNG files); the unit tests check the search, the segmenting, the
spec runner and the table logic.
"""
import copy
import json
import os
import os.path as osp

import pytest
import torch

from mmdtr.benchmarking import (NO_EVICTION, BenchmarkSuite, Launcher,
                                Workload, apply_technique, block_names,
                                checkpoint_segments, largest_fitting,
                                load_config, make_spec, run_spec, split_even)
from mmdtr.benchmarking.launch import default_launcher
from mmdtr.benchmarking.worker import RESULT_PREFIX
from mmdtr.dtr import DTR
from mmdtr.errors import MmdtrError

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
RESNET = osp.join(REPO, 'configs', 'resnet50_synthetic.py')
GPT = osp.join(REPO, 'configs', 'gpt_synthetic.py')
# A small ResNet keeps the end-to-end run short.
SMALL = dict(model=dict(depth=18, base_channels=8))
RUN_KEYS = {
    'name', 'technique', 'policy', 'threshold', 'batch_size', 'status',
    'error', 'median_step_s', 'step_times_s', 'peak_engine',
    'peak_independent', 'independent_meter', 'evictions', 'recomputations',
    'eviction_failures', 'remat_seconds', 'wall_s', 'log'
}


@pytest.fixture(scope='module')
def quick_run(tmp_path_factory, benchmark_cli):
    work_dir = tmp_path_factory.mktemp('bench')
    proc = benchmark_cli('all', '--quick', '--work-dir', str(work_dir),
                         '--cfg-options', 'model.depth=18',
                         'model.base_channels=8')
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work_dir, proc


def test_quick_writes_json_of_every_run(quick_run):
    work_dir, _ = quick_run
    with open(work_dir / 'results.json') as f:
        results = json.load(f)
    assert set(results) == {'meta', 'sweep', 'compare', 'largest_batch'}
    assert {'cpu', 'cpu_count', 'torch', 'device'} <= set(results['meta'])
    sweep = results['sweep']['runs']
    assert [r['name'] for r in sweep] == [
        'baseline', 'dispatch floor', 'dtr (no eviction)', 'dtr@0.5',
        'dtr@0.25'
    ]
    compare = results['compare']['runs']
    assert [r['name'] for r in compare] == [
        'baseline', 'checkpoint_sqrt', 'mmengine_ac', 'mmdtr_ac', 'dtr[dtr]',
        'dtr[dtr_local]', 'dtr[lru]', 'dtr[largest]'
    ]
    for run in sweep + compare:
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert run['status'] == 'ok', (run['name'], run['error'])
        assert len(run['step_times_s']) == 1  # --quick: one measured step
        assert run['peak_engine'] > 0 and run['peak_independent'] > 0
        assert run['independent_meter'] == 'torch.profiler'
        assert osp.isfile(run['log'])
    # thresholds are fractions of the peak of DTR without eviction
    peak = sweep[2]['peak_engine']
    assert sweep[3]['threshold'] == int(peak * 0.5)
    assert sweep[4]['threshold'] == int(peak * 0.25)
    # the floor runs the same steps as the baseline, op for op
    assert sweep[1]['loss'] == sweep[0]['loss']
    # every run counts the ops in scope (runs without DTR: the meter's
    # step); DTR without eviction ran idle after its warm-up (R16), where
    # autograd saves tensors itself and dispatches fewer ops
    recorded = [run for i, run in enumerate(sweep) if i != 2]
    assert len({run['ops'] for run in recorded}) == 1 and sweep[0]['ops'] > 0
    assert 0 < sweep[2]['idle_ops'] == sweep[2]['ops'] <= sweep[0]['ops']
    assert sweep[3]['idle_ops'] == 0  # it evicts: recorded
    # compare matches DTR's threshold to the sqrt(N) checkpointing's peak
    assert {r['threshold'] for r in compare[4:]} == {compare[1]['peak_engine']}
    batch = results['largest_batch']['result']
    for technique in ('baseline', 'dtr'):
        entry = batch[technique]
        assert entry['error'] is None
        fitting = [p['batch_size'] for p in entry['probes'] if p['fits']]
        assert entry['largest_batch'] == max(fitting, default=0)
        assert all(p['peak_engine'] <= batch['capacity']
                   for p in entry['probes'] if p['fits'])
    assert batch['dtr']['largest_batch'] >= batch['baseline']['largest_batch']


def test_quick_writes_table_and_plots(quick_run, benchmark_cli):
    work_dir, proc = quick_run
    table = (work_dir / 'benchmark.md').read_text()
    for heading in ('## Threshold sweep', '## Alternatives at the same '
                    'memory', '## Largest batch'):
        assert heading in table
    rows = [line for line in table.splitlines() if line.startswith('| ')]
    names = [row.split('|')[1].strip() for row in rows]
    for name in ('baseline', 'dispatch floor', 'dtr (no eviction)', 'dtr@0.5',
                 'dtr@0.25', 'checkpoint_sqrt', 'mmengine_ac', 'mmdtr_ac',
                 'dtr[lru]', 'dtr'):
        assert name in names
    for png in ('sweep.png', 'time_vs_peak.png'):
        with open(work_dir / png, 'rb') as f:
            assert f.read(8) == b'\x89PNG\r\n\x1a\n'
        assert f'wrote {work_dir / png}' in proc.stdout
    # the report command redraws everything from the JSON alone
    os.remove(work_dir / 'benchmark.md')
    proc = benchmark_cli('report', '--work-dir', str(work_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (work_dir / 'benchmark.md').read_text() == table


@pytest.mark.parametrize('limit', [0, 1, 2, 3, 5, 8, 13, 31, 32, 100])
def test_largest_fitting_finds_the_limit(limit):
    calls = []

    def fits(batch):
        calls.append(batch)
        return batch <= limit

    best, probes = largest_fitting(fits, max_batch=64)
    assert best == min(limit, 64)
    assert len(calls) == len(set(calls)) == len(probes)
    assert len(calls) <= 2 * 7 + 1  # doubling, then bisecting


def test_largest_fitting_starts_where_told():
    best, probes = largest_fitting(lambda b: b <= 11, 64, start=4)
    assert best == 11 and min(probes) == 4
    best, probes = largest_fitting(lambda b: b <= 2, 64, start=4)
    assert best == 2 and probes[4] is False


def test_largest_batch_starts_at_start_batch(monkeypatch, tmp_path):
    suite = BenchmarkSuite(
        Launcher('subprocess', str(tmp_path)), progress=False, device='cpu')
    limits, tried = dict(baseline=40, dtr=100), []

    def probe(technique, batch, capacity, policy, bar, headroom=0):
        tried.append((technique, batch))
        return dict(status='ok', fits=batch <= limits[technique])

    monkeypatch.setattr(suite, 'probe', probe)
    out = suite.largest_batch(2**30, 1024, start_batch=32)
    assert out['start_batch'] == 32
    assert out['baseline']['largest_batch'] == 40
    assert out['dtr']['largest_batch'] == 100
    assert min(b for t, b in tried if t == 'baseline') == 32
    assert min(b for t, b in tried if t == 'dtr') == 40  # the baseline's
    tried.clear()  # a start above the baseline's limit: bisected below it
    out = suite.largest_batch(2**30, 1024, start_batch=64)
    assert out['baseline']['largest_batch'] == 40
    assert out['dtr']['largest_batch'] == 100
    assert tried[0] == ('baseline', 64)
    assert min(b for t, b in tried if t == 'dtr') == 64


def test_split_even():
    assert split_even(list(range(16)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7],
                                              [8, 9, 10, 11], [12, 13, 14, 15]]
    groups = split_even(list(range(20)), 4)
    assert [len(g) for g in groups] == [5, 5, 5, 5]
    assert [len(g) for g in split_even(list(range(8)), 3)] == [3, 3, 2]
    assert split_even([1, 2], 5) == [[1], [2]]


def _small_workload(batch=4, optimizer='none'):
    cfg = load_config(RESNET, SMALL, image_size=64)
    return Workload(cfg, batch, optimizer=optimizer)


def test_sgd_in_backward_steps_like_sgd_after_backward():
    after, during = _small_workload(2, 'sgd'), _small_workload(
        2, 'sgd_in_backward')
    for _ in range(2):  # under DTR: the engine sees the in-place steps
        assert after.step() == during.step(
            DTR(eviction_threshold=NO_EVICTION, device='cpu'))
    assert all(p.grad is None for p in during.model.parameters())
    for (name, p), q in zip(after.model.named_parameters(),
                            during.model.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(MmdtrError, match="'adam' is not one of"):
        _small_workload(2, 'adam')


def test_checkpoint_segments_keep_loss_and_gradients():
    plain = _small_workload()
    ckpt = copy.deepcopy(plain)
    names = block_names(ckpt.model)
    assert names == [
        f'backbone.layer{i}.{j}' for i in range(1, 5) for j in range(2)
    ]
    segments = checkpoint_segments(ckpt.model, names)
    assert segments == [names[:3], names[3:6], names[6:]]  # round(sqrt(8))
    for work in (plain, ckpt):
        loss = work.model(**work.batch, mode='loss')['loss']
        loss.backward()
        work.loss = loss
    assert torch.equal(plain.loss, ckpt.loss)
    for (name, p), q in zip(plain.model.named_parameters(),
                            ckpt.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_apply_technique_describes_what_it_did():
    work = _small_workload()
    assert apply_technique(work.model, 'mmdtr_ac') == 'each of 8 blocks'
    work = _small_workload()
    assert apply_technique(work.model, 'checkpoint_sqrt') == \
        '3 segments of 8 blocks'
    with pytest.raises(MmdtrError, match='unknown'):
        apply_technique(work.model, 'magic')
    with pytest.raises(MmdtrError, match='--blocks'):
        block_names(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_overrides_must_fit_the_dataset():
    cfg = load_config(GPT, seq_len=16)
    assert cfg.train_dataloader.dataset.seq_len == 16
    with pytest.raises(MmdtrError, match='--image-size'):
        load_config(GPT, image_size=32)


@pytest.mark.parametrize('recording', ['auto', 'always'])
def test_dtr_runs_choose_the_recording_threshold_as_the_hook(recording):
    """'auto': the warm-up step fit under half the threshold, so the
    measured one records nothing (R16); 'always': it records every op."""
    result = run_spec(
        make_spec(
            RESNET,
            'dtr',
            2,
            cfg_options=SMALL,
            image_size=64,
            threshold=NO_EVICTION,
            recording=recording,
            warmup=1,
            steps=1,
            profile=False))
    assert result['status'] == 'ok', result['error']
    assert result['ops'] > 0
    assert result['idle_ops'] == (result['ops'] if recording == 'auto' else 0)


def test_run_spec_in_process_and_in_a_subprocess(tmp_path, capsys):
    common = dict(cfg_options=SMALL, image_size=64, warmup=0)
    meter_spec = make_spec(
        RESNET,
        'dtr',
        2,
        threshold=NO_EVICTION,
        steps=1,
        profile=False,
        **common)
    meter = run_spec(meter_spec)
    assert meter['status'] == 'ok', meter['error']
    assert meter['evictions'] == 0 and meter['peak_engine'] > 0
    assert meter['peak_independent'] is None  # profile=False

    spec = make_spec(
        RESNET,
        'dtr',
        2,
        steps=2,
        threshold=int(meter['peak_engine'] * 0.7),
        evictee_minimum_size=4096,
        **common)
    result = run_spec(spec)
    assert result['status'] == 'ok', result['error']
    assert len(result['step_times_s']) == 2
    assert result['evictions'] > 0
    assert result['independent_meter'] == 'torch.profiler'

    assert RESULT_PREFIX not in capsys.readouterr().out  # launched runs'

    # the same run in a fresh process meters the same bytes
    for kind in {'subprocess', default_launcher('cpu')}:
        launched = Launcher(kind, str(tmp_path)).run(meter_spec, kind)
        assert launched['status'] == 'ok', launched['error']
        assert launched['peak_engine'] == meter['peak_engine']
        with open(launched['log']) as f:  # its last line holds the result
            last = f.read().splitlines()[-1]
        assert last.startswith(RESULT_PREFIX)
        assert json.loads(last[len(RESULT_PREFIX):]) == {
            k: v
            for k, v in launched.items() if k != 'log'
        }
    bad = run_spec(dict(spec, config=str(tmp_path / 'missing.py')))
    assert bad['status'] == 'error' and 'missing.py' in bad['error']
