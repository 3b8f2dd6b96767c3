"""One measured run of the benchmark, meant to run in a process of its own.

A run is described by a JSON-able *spec* (see :func:`make_spec`) and
returns a JSON-able *result*. :func:`run_spec` does the work; run as a
module (``python -m mmdtr.benchmarking.worker SPEC RESULT``) it reads the
spec from a file and writes the result to another, which is how
:mod:`mmdtr.benchmarking.launch` starts it in a fresh interpreter.

What a run measures, in this order:

1. ``warmup`` training steps (not measured);
2. ``steps`` timed training steps; their median is the step time. Under DTR
   each step has its own engine, and the engine's meter gives the peak
   (the largest over the steps), with the evictions, recomputations,
   eviction failures and ops (means per step); technique
   ``dispatch_floor`` runs each step under a fresh
   :class:`~.workloads.DispatchFloor` instead;
3. without DTR, one more step metered by a DTR engine whose threshold is
   never reached (:data:`~.workloads.NO_EVICTION`): the engine's peak of a
   run that evicts nothing;
4. the independent peak: on CPU one more step under
   :func:`~mmdtr.utils.profiler_memory.measure_memory` (the profiler's
   memory events); on CUDA ``torch.cuda.max_memory_allocated`` over the
   timed steps.
"""
import json
import os
import statistics
import sys
import time
import traceback
from typing import Optional

import torch
# The optimizers import dynamo on first use (seconds); import it once here,
# so that the fork server of the launcher has it for every run.
import torch._dynamo  # noqa: F401

from mmdtr.core.recording_threshold import RecentSteps
from mmdtr.dtr import DTR
from mmdtr.utils.profiler_memory import measure_memory
from .workloads import (NO_EVICTION, DispatchFloor, Workload, apply_technique,
                        load_config)

#: Starts the last line of a run's log, followed by the result as JSON.
RESULT_PREFIX = 'mmdtr-benchmark result: '
_OOM = torch.cuda.OutOfMemoryError  # torch.OutOfMemoryError since 2.5


def make_spec(config: str,
              technique: str,
              batch_size: int,
              *,
              cfg_options: Optional[dict] = None,
              image_size: Optional[int] = None,
              seq_len: Optional[int] = None,
              device: str = 'cpu',
              threshold: Optional[int] = None,
              policy: str = 'dtr',
              evictee_minimum_size: int = 2**20,
              sqrt_sampling: bool = False,
              recording: str = 'auto',
              warmup: int = 1,
              steps: int = 3,
              optimizer: str = 'sgd',
              blocks: Optional[str] = None,
              meter: bool = True,
              profile: bool = True,
              capacity: Optional[int] = None,
              threads: Optional[int] = None,
              seed: int = 0) -> dict:
    """Describe one run. Arguments are as in ``tools/benchmark.py``.

    Args:
        config (str): Path of the workload config.
        technique (str): One of :data:`~.workloads.TECHNIQUES`.
        batch_size (int): Samples in the batch.
        cfg_options (dict, optional): ``--cfg-options`` to merge.
        image_size (int, optional): Image side of an image dataset.
        seq_len (int, optional): Sequence length of a token dataset.
        device (str): ``'cpu'``, ``'cuda'`` or ``'cuda:N'``.
            Defaults to ``'cpu'``.
        threshold (int, optional): The DTR threshold in bytes
            (``technique='dtr'`` only).
        policy (str): DTR's eviction policy. Defaults to ``'dtr'``.
        evictee_minimum_size (int): DTR's ``evictee_minimum_size`` in
            bytes. Defaults to 1 MiB.
        sqrt_sampling (bool): DTR scores about sqrt(N) sampled eviction
            candidates. Defaults to False.
        recording (str): ``'auto'``: each DTR step's
            ``recording_threshold`` follows from the recent steps'
            statistics, as ``DTRHook`` chooses it by default
            (design.md R16); ``'always'``: every op recorded. Defaults to
            ``'auto'``.
        warmup (int): Steps before the measured ones. Defaults to 1.
        steps (int): Measured steps. Defaults to 3.
        optimizer (str): One of :data:`~.workloads.OPTIMIZERS`.
            Defaults to ``'sgd'``.
        blocks (str, optional): Glob of the blocks the alternatives
            checkpoint; defaults to the model's.
        meter (bool): Step 3 of the module docstring (the engine-metered
            step of a run without DTR). Defaults to True.
        profile (bool): Step 4 on CPU (the profiler-metered step).
            Defaults to True.
        capacity (int, optional): Bytes of CUDA memory this process may
            use (``torch.cuda.set_per_process_memory_fraction``).
        threads (int, optional): ``torch.set_num_threads`` of the run.
        seed (int): Seeds torch before the model is built. Defaults to 0.

    Returns:
        dict: The spec, JSON-able: the arguments by name, ``batch_size`` as
        an int and ``cfg_options`` as a dict.
    """
    return dict(
        config=config,
        technique=technique,
        batch_size=int(batch_size),
        cfg_options=cfg_options or {},
        image_size=image_size,
        seq_len=seq_len,
        device=device,
        threshold=threshold,
        policy=policy,
        evictee_minimum_size=evictee_minimum_size,
        sqrt_sampling=sqrt_sampling,
        recording=recording,
        warmup=warmup,
        steps=steps,
        optimizer=optimizer,
        blocks=blocks,
        meter=meter,
        profile=profile,
        capacity=capacity,
        threads=threads,
        seed=seed)


def _limit_cuda_memory(device: torch.device, capacity: int) -> None:
    if device.index is None:  # the memory fraction needs an index
        device = torch.device('cuda', torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, capacity / total), device)


def _measure(spec: dict, result: dict) -> None:
    if spec.get('threads'):
        torch.set_num_threads(spec['threads'])
    result['num_threads'] = torch.get_num_threads()
    device = torch.device(spec['device'])
    cuda = device.type == 'cuda'
    if cuda and spec.get('capacity'):
        _limit_cuda_memory(device, spec['capacity'])
    cfg = load_config(spec['config'], spec['cfg_options'], spec['image_size'],
                      spec['seq_len'])
    work = Workload(cfg, spec['batch_size'], spec['device'], spec['optimizer'],
                    spec['seed'])
    dtr = spec['technique'] == 'dtr'
    result['applied'] = apply_technique(work.model, spec['technique'],
                                        spec['blocks'])

    auto = spec.get('recording', 'auto') == 'auto'
    recent = RecentSteps()  # of the DTR steps (R16)

    def engine():
        if spec['technique'] == 'dispatch_floor':
            return DispatchFloor()
        if not dtr:
            return None
        return DTR(
            eviction_threshold=spec['threshold'],
            evictee_minimum_size=spec['evictee_minimum_size'],
            enable_sqrt_sampling=spec['sqrt_sampling'],
            policy=spec['policy'],
            device=device,
            recording_threshold=recent.next_threshold() if auto else None)

    def step(eng):
        loss = work.step(eng)
        if isinstance(eng, DTR):
            recent.add(eng.stats)
        return loss

    for _ in range(spec['warmup']):
        step(engine())
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, stats = [], []
    for _ in range(spec['steps']):
        eng = engine()
        start = time.perf_counter()
        result['loss'] = step(eng)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        if dtr:
            stats.append(eng.stats)
    result['step_times_s'] = times
    result['median_step_s'] = statistics.median(times) if times else None
    if cuda and times:
        result['peak_independent'] = torch.cuda.max_memory_allocated(device)
        result['independent_meter'] = 'torch.cuda.max_memory_allocated'
    if not dtr and spec['meter']:
        eng = DTR(eviction_threshold=NO_EVICTION, device=device)
        work.step(eng)
        stats.append(eng.stats)
    if stats:
        result['peak_engine'] = max(s.peak_memory for s in stats)
        for key in ('evictions', 'recomputations', 'eviction_failures',
                    'remat_seconds', 'ops', 'idle_ops'):
            result[key] = statistics.fmean(getattr(s, key) for s in stats)
    if not cuda and spec['profile']:
        measured = measure_memory(step, (engine(), ))
        result['peak_independent'] = measured.peak_bytes
        result['independent_meter'] = 'torch.profiler'


def run_spec(spec: dict) -> dict:
    """Do the run ``spec`` describes; never raises.

    Args:
        spec (dict): From :func:`make_spec`.

    Returns:
        dict: ``status`` (``'ok'``, ``'oom'`` when CUDA ran out of memory,
        or ``'error'`` with ``error``), ``median_step_s``,
        ``step_times_s``, ``peak_engine``, ``peak_independent`` and
        ``independent_meter``, ``evictions``, ``recomputations``,
        ``eviction_failures``, ``remat_seconds``, ``ops`` (per step: ops
        the engine saw, in the metering step for runs without DTR),
        ``idle_ops`` (per step: of those, ops run before recording
        started), ``loss``,
        ``applied``, ``num_threads``, ``wall_s``, ``load_average`` (the
        1-minute load average at start and end); missing figures are None.
    """
    result = dict(
        status='ok',
        error=None,
        median_step_s=None,
        step_times_s=[],
        peak_engine=None,
        peak_independent=None,
        independent_meter=None,
        evictions=None,
        recomputations=None,
        eviction_failures=None,
        remat_seconds=None,
        ops=None,
        idle_ops=None)
    start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, 'getloadavg') else None
    try:
        _measure(spec, result)
    except _OOM as error:
        result['status'] = 'oom'
        result['error'] = str(error).splitlines()[0] if str(error) else 'OOM'
    except Exception as error:  # noqa: B902 - reported, never raised
        traceback.print_exc()
        result['status'] = 'error'
        result['error'] = f'{type(error).__name__}: {error}'
    result['wall_s'] = time.perf_counter() - start
    if load is not None:  # 1-minute load average at start and end
        result['load_average'] = [round(load, 2), round(os.getloadavg()[0], 2)]
    return result


def log_result(result: dict) -> None:
    """End a launched run's log (its stdout) with its result as JSON, so
    that a search cut off before ``results.json`` leaves what it found.

    Args:
        result (dict): From :func:`run_spec`; printed after
            :data:`RESULT_PREFIX`.
    """
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def main(argv=None) -> None:
    """``python -m mmdtr.benchmarking.worker SPEC.json RESULT.json``.

    Reads the spec, runs it and writes the result, then logs it
    (:func:`log_result`).

    Args:
        argv (list, optional): ``[SPEC.json, RESULT.json]``; by default
            ``sys.argv[1:]``.
    """
    spec_path, result_path = (argv if argv is not None else sys.argv[1:])
    with open(spec_path) as f:
        spec = json.load(f)
    result = run_spec(spec)
    with open(result_path, 'w') as f:
        json.dump(result, f)
    log_result(result)


if __name__ == '__main__':
    main()
