"""The largest-batch benchmark: a doubling-then-bisecting search per
technique, each probe a run of its own.

:func:`largest_fitting` is the search; :class:`LargestBatchSearch` holds
the largest-batch methods of :class:`~.suite.BenchmarkSuite` (this mixin
only groups them).
"""
from typing import Callable, Dict, List, Tuple

from .launch import Progress

#: Probe statuses that mean "does not fit" (CUDA OOM; killed, e.g. by the
#: kernel's OOM killer); any other failure stops the search.
_NOT_FITTING = ('oom', 'killed')


def probe_steps(cuda: bool, technique: str) -> dict:
    """The warm-up and timed steps of one largest-batch probe.

    On CUDA, one warm-up step and one timed step (the allocator's peak);
    on CPU, one timed DTR step, or for the others only the engine-metered
    step that every run adds.

    Args:
        cuda (bool): Whether the probes run on CUDA.
        technique (str): ``'dtr'`` or another run's technique.

    Returns:
        dict: ``warmup`` and ``steps``.
    """
    if cuda:
        return dict(warmup=1, steps=1)
    return dict(warmup=0, steps=1 if technique == 'dtr' else 0)


class _ProbeFailed(Exception):

    def __init__(self, record: dict):
        super().__init__(record.get('error'))
        self.record = record


def largest_fitting(fits: Callable[[int], bool],
                    max_batch: int,
                    start: int = 1) -> Tuple[int, Dict[int, bool]]:
    """Largest batch for which ``fits`` holds: doubling, then bisecting.

    ``fits`` is assumed monotone (true up to some batch, false above).

    Args:
        fits (Callable[[int], bool]): Whether a batch size fits.
        max_batch (int): Largest batch tried.
        start (int): First batch tried; the doubling starts there.
            Defaults to 1.

    Returns:
        tuple: ``(largest, probes)``: the largest fitting batch (0 when
        none does) and every batch tried with its outcome.
    """
    probes: Dict[int, bool] = {}

    def probe(batch: int) -> bool:
        if batch not in probes:
            probes[batch] = bool(fits(batch))
        return probes[batch]

    start = max(1, min(start, max_batch))
    good, bad, batch = 0, None, start
    while batch <= max_batch:
        if not probe(batch):
            bad = batch
            break
        good, batch = batch, batch * 2
    if bad is None:
        if good == max_batch or probe(max_batch):
            return max_batch, probes
        bad = max_batch
    while bad - good > 1:
        mid = (good + bad) // 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return good, probes


class LargestBatchSearch:
    """Largest-batch probes and search; mixed into ``BenchmarkSuite``.

    Uses the suite's ``cuda``, ``spec``, ``run`` and ``bar``.
    """

    def probe(self,
              technique: str,
              batch: int,
              capacity: int,
              policy: str,
              bar: Progress,
              headroom: int = 0) -> dict:
        """One largest-batch probe: does ``batch`` fit in ``capacity``?

        On CPU the engine's meter decides (baseline: an engine that never
        evicts; DTR: threshold ``capacity - headroom``), one step, no
        warm-up. On CUDA the process may use only ``capacity`` bytes of the
        card, DTR's threshold is ``capacity - headroom`` too, and a run fits
        when it finishes a warm-up step and a measured step without running
        out of memory.

        Args:
            technique (str): ``'baseline'`` or ``'dtr'``.
            batch (int): The batch size tried.
            capacity (int): The memory capacity in bytes.
            policy (str): DTR's eviction policy.
            bar (Progress): Counts the run.
            headroom (int): Bytes below ``capacity`` of DTR's threshold.
                Defaults to 0.

        Returns:
            dict: The run's record (see :meth:`run`), with ``fits``.
        """
        overrides = dict(
            batch_size=batch,
            profile=False,
            **probe_steps(self.cuda, technique))
        if technique == 'dtr':
            overrides.update(threshold=capacity - headroom, policy=policy)
        if self.cuda:
            overrides.update(capacity=capacity, meter=False)
        elif technique != 'dtr':
            overrides.update(meter=True)
        record = self.run(f'{technique}@batch{batch}',
                          self.spec(technique, **overrides), bar)
        peak = record['peak_engine']
        record['fits'] = record['status'] == 'ok' and (self.cuda or
                                                       (peak is not None
                                                        and peak <= capacity))
        return record

    def largest_batch(self,
                      capacity: int,
                      max_batch: int = 1024,
                      policy: str = 'dtr',
                      headroom: int = 0,
                      start_batch: int = 1) -> dict:
        """Largest batch of the baseline and of DTR within ``capacity``.

        DTR runs at threshold ``capacity - headroom``: the engine evicts
        after an op that crosses the threshold, so its peak may pass the
        threshold by about the largest op's output; a headroom keeps that
        within the capacity. The baseline's doubling starts at
        ``start_batch``, DTR's at the larger of that and the baseline's
        largest batch (on a big card, a start near the baseline's limit
        saves the probes of small batches, each a fresh process).
        A probe that fails otherwise than by running out of memory stops
        that technique's search (``largest_batch`` None, ``error`` set).

        Args:
            capacity (int): The memory capacity in bytes.
            max_batch (int): Largest batch tried. Defaults to 1024.
            policy (str): DTR's eviction policy. Defaults to ``'dtr'``.
            headroom (int): Bytes below ``capacity`` of DTR's threshold.
                Defaults to 0.
            start_batch (int): First batch the baseline tries. Defaults
                to 1.

        Returns:
            dict: ``capacity``, ``max_batch``, ``policy``, ``headroom``,
            ``start_batch``, ``criterion``
            and, per technique (``baseline``, ``dtr``), ``largest_batch``,
            ``error`` and ``probes`` (the probe records in the order run).
        """
        bar = self.bar(None, 'largest batch')
        out = dict(
            capacity=capacity,
            max_batch=max_batch,
            policy=policy,
            headroom=headroom,
            start_batch=start_batch,
            criterion=('no CUDA OOM with set_per_process_memory_fraction'
                       if self.cuda else 'engine-metered peak <= capacity'))
        start = start_batch
        for technique in ('baseline', 'dtr'):
            probes: List[dict] = []

            def fits(batch: int, technique=technique, probes=probes):
                probes.append(
                    self.probe(technique, batch, capacity, policy, bar,
                               headroom))
                if probes[-1]['status'] not in _NOT_FITTING + ('ok', ):
                    raise _ProbeFailed(probes[-1])
                return probes[-1]['fits']

            try:
                best, _ = largest_fitting(fits, max_batch, start=start)
                error = None
            except _ProbeFailed as failed:
                best = None
                error = (f"batch {failed.record['batch_size']}: "
                         f"{failed.record['status']}: "
                         f"{failed.record['error']}")
            out[technique] = dict(
                largest_batch=best, probes=probes, error=error)
            start = max(start_batch, best or 1)
        bar.close()
        return out
