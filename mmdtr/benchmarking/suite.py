"""The three benchmarks: threshold sweep, alternatives, largest batch.

:class:`BenchmarkSuite` turns the tool's settings into run specs, starts
each run in its own process (:class:`~.launch.Launcher`) and returns
JSON-able records: the run's result with its name, technique, policy,
threshold and batch size. Identical specs are run once per suite. The
largest-batch methods are :class:`~.largest_batch.LargestBatchSearch`'s.
"""
import json
import statistics
from typing import Dict, List, Optional, Sequence

from mmdtr.core.policies import POLICIES
from mmdtr.errors import MmdtrError
from .largest_batch import LargestBatchSearch
from .launch import Launcher, Progress
from .worker import make_spec
from .workloads import NO_EVICTION

#: The techniques compared with DTR at the same memory.
ALTERNATIVES = ('checkpoint_sqrt', 'mmengine_ac', 'mmdtr_ac')


def _no_peak(record: dict) -> str:
    """Why ``record`` (DTR without eviction) gives no peak to scale."""
    if record['status'] != 'ok':
        return (f"no peak to take fractions of: {record['name']} ended "
                f"{record['status']!r}")
    return (f"no peak to take fractions of: {record['name']} metered "
            f"{record['peak_engine']!r} bytes")


class BenchmarkSuite(LargestBatchSearch):
    """Builds specs from shared settings, runs them, keeps the records.

    Args:
        launcher (Launcher): Starts the runs.
        progress (bool): Show progress bars.
        repeats (int): Rounds of the sweep's runs, their measured steps
            pooled. Defaults to 1.
        **settings: Keyword arguments of
            :func:`~mmdtr.benchmarking.worker.make_spec` shared by all
            runs: ``config``, ``batch_size``, ``device``, ``warmup``, ...
    """

    def __init__(self,
                 launcher: Launcher,
                 progress: bool = True,
                 repeats: int = 1,
                 **settings):
        self.launcher, self.progress = launcher, progress
        self.repeats = repeats
        self.settings = settings
        self._cache: Dict[str, dict] = {}

    @property
    def cuda(self) -> bool:
        """Whether the runs' ``device`` setting is a CUDA device."""
        return str(self.settings.get('device', 'cpu')).startswith('cuda')

    def spec(self, technique: str, **overrides) -> dict:
        """A spec from the shared settings and ``overrides``.

        Args:
            technique (str): One of :data:`~.workloads.TECHNIQUES`.
            **overrides: Keyword arguments of
                :func:`~mmdtr.benchmarking.worker.make_spec` that replace
                the shared ones.

        Returns:
            dict: The spec.
        """
        kwargs = dict(self.settings)
        kwargs.update(overrides)
        config, batch_size = kwargs.pop('config'), kwargs.pop('batch_size')
        return make_spec(config, technique, batch_size, **kwargs)

    def run(self, name: str, spec: dict, bar: Progress, **extra) -> dict:
        """Run ``spec`` (once per suite) and return its record.

        Args:
            name (str): The run's name, for the record, the log and the bar.
            spec (dict): From :meth:`spec`.
            bar (Progress): Counts the run.
            **extra: More keys of the record, e.g. ``fraction``.

        Returns:
            dict: ``name``, ``technique``, ``policy`` (DTR only),
            ``threshold``, ``batch_size``, the keys of ``extra`` and the
            run's result; with ``repeats`` > 1 also ``spec`` and
            ``repeats``.
        """
        key = json.dumps(spec, sort_keys=True)
        bar.set_label(name)
        if key not in self._cache:
            self._cache[key] = self.launcher.run(spec, name)
        record = dict(
            name=name,
            technique=spec['technique'],
            policy=spec['policy'] if spec['technique'] == 'dtr' else None,
            threshold=spec['threshold'],
            batch_size=spec['batch_size'])
        record.update(extra)
        record.update(self._cache[key])
        if self.repeats > 1:
            record['spec'], record['repeats'] = spec, 1
        bar.update(f'{name}: {record["status"]}')
        return record

    def bar(self, total: Optional[int], desc: str) -> Progress:
        """A progress bar (silent unless the suite shows progress).

        Args:
            total (int | None): Runs expected, or None when unknown.
            desc (str): Label in front of the bar.

        Returns:
            Progress: The bar.
        """
        return Progress(total, desc, enabled=self.progress)

    def sweep(self,
              fractions: Sequence[float] = (),
              thresholds: Sequence[int] = (),
              policy: str = 'dtr') -> List[dict]:
        """Baseline, the dispatch floor, DTR without eviction, DTR at each
        threshold.

        Args:
            fractions (Sequence[float]): Thresholds as fractions of the
                peak of DTR without eviction (the engine's meter).
            thresholds (Sequence[int]): Thresholds in bytes.
            policy (str): The eviction policy.

        Returns:
            list[dict]: Records; ``fraction`` is set on fraction runs.
        """
        runs = 3 + len(fractions) + len(thresholds)
        bar = self.bar(runs * self.repeats, 'sweep')
        records = [self.baseline(bar), self.dispatch_floor(bar)]
        no_eviction = self.no_eviction(bar, policy)
        records.append(no_eviction)
        peak = no_eviction['peak_engine']
        for fraction in fractions:
            why = _no_peak(no_eviction) if not peak else None
            if peak and int(peak * fraction) < 1:  # threshold 0: refused
                # by the engine, after the runs before it (an audit)
                why = (f'{fraction:g} of the peak ({peak} bytes) is below '
                       '1 byte')
            if why:
                records.append(
                    self._skipped(
                        f'dtr@{fraction:g}',
                        'dtr',
                        policy,
                        why,
                        fraction=fraction))
                bar.update()
                continue
            records.append(
                self.run(
                    f'dtr@{fraction:g}',
                    self.spec(
                        'dtr', threshold=int(peak * fraction), policy=policy),
                    bar,
                    fraction=fraction))
        for threshold in thresholds:
            records.append(
                self.run(
                    f'dtr@{threshold}B',
                    self.spec('dtr', threshold=int(threshold), policy=policy),
                    bar))
        for repeat in range(2, self.repeats + 1):
            # even rounds go backwards: a steady drift of the machine's
            # speed within a round falls on the first and the last runs alike
            for record in records[::-1] if repeat % 2 == 0 else records:
                self._repeat(record, repeat, bar)
        bar.close()
        return records

    def _repeat(self, record: dict, repeat: int, bar: Progress) -> None:
        """Run ``record``'s spec again and pool its step times into it.

        Rounds go through every run in turn, every other round backwards,
        so a drift in the machine's speed (other tenants, thermal state)
        falls on all runs alike.
        """
        spec = record.get('spec')
        if spec is None or record['status'] != 'ok':
            bar.update()
            return
        name = f"{record['name']} (repeat {repeat})"
        bar.set_label(name)
        more = self.launcher.run(spec, name)
        bar.update(f'{name}: {more["status"]}')
        if more['status'] != 'ok':  # said in its status, counted as failed
            # (a run pooled from fewer rounds than the others undoes the
            # interleaving; found by an audit)
            record['lost_repeats'] = record.get('lost_repeats', 0) + 1
            return
        record['step_times_s'] = record['step_times_s'] + more['step_times_s']
        record['median_step_s'] = statistics.median(record['step_times_s'])
        pooled = record['repeats']  # rounds pooled so far (a lost one is
        # not: found by a review)
        record['repeats'] = pooled + 1
        # each pooled round's load average, to spot a slowed round
        record['round_load_averages'] = record.get(
            'round_load_averages',
            [record.get('load_average')]) + [more.get('load_average')]
        # the per-step counts shown are the first round's: where another
        # round's differ, each round's are kept for the report
        # (dropped while every round so far agreed with the first)
        rounds = record.get('round_counts') or [_counts(record)] * pooled
        record['round_counts'] = rounds + [_counts(more)]
        if all(r == rounds[0] for r in record['round_counts']):
            del record['round_counts']

    def baseline(self, bar: Progress) -> dict:
        """The run without any technique (engine-metered in an extra step).

        Args:
            bar (Progress): Counts the run.

        Returns:
            dict: Its record (see :meth:`run`).
        """
        return self.run('baseline', self.spec('baseline'), bar)

    def dispatch_floor(self, bar: Progress) -> dict:
        """An empty dispatch mode and saved-tensor hooks: what any engine
        built as DTR is pays (see :class:`~.workloads.DispatchFloor`).

        Args:
            bar (Progress): Counts the run.

        Returns:
            dict: Its record (see :meth:`run`).
        """
        return self.run('dispatch floor', self.spec('dispatch_floor'), bar)

    def no_eviction(self, bar: Progress, policy: str = 'dtr') -> dict:
        """DTR at a threshold never reached: overhead and baseline peak.

        Args:
            bar (Progress): Counts the run.
            policy (str): The eviction policy. Defaults to ``'dtr'``.

        Returns:
            dict: Its record (see :meth:`run`).
        """
        return self.run('dtr (no eviction)',
                        self.spec('dtr', threshold=NO_EVICTION, policy=policy),
                        bar)

    def _skipped(self, name: str, technique: str, policy: Optional[str],
                 why: str, **extra) -> dict:
        record = dict(
            name=name,
            technique=technique,
            policy=policy,
            threshold=None,
            batch_size=self.settings['batch_size'],
            status='skipped',
            error=why,
            median_step_s=None,
            step_times_s=[],
            peak_engine=None,
            peak_independent=None)
        record.update(extra)
        return record

    def compare(
        self,
        match: str = 'checkpoint_sqrt',
        policies: Sequence[str] = tuple(POLICIES)
    ) -> List[dict]:
        """The checkpointing alternatives, then DTR per policy at a peak.

        Args:
            match (str | int): An alternative of :data:`ALTERNATIVES` whose
                engine-metered peak is DTR's threshold, or a threshold in
                bytes.
            policies (Sequence[str]): DTR's eviction policies to run.

        Returns:
            list[dict]: Records; the DTR ones carry ``matched_to``.
        """
        bar = self.bar(1 + len(ALTERNATIVES) + len(policies), 'compare')
        records = [self.baseline(bar)]
        for technique in ALTERNATIVES:
            records.append(self.run(technique, self.spec(technique), bar))
        if isinstance(match, int):
            threshold, matched = match, f'{match} bytes'
        else:
            found = [r for r in records if r['technique'] == match]
            if not found:
                raise MmdtrError(
                    f'--match {match!r} is not one of '
                    f'{list(ALTERNATIVES)} or a size.',
                    hint='give one of those names, or the threshold in '
                    'bytes as an int (parse_match turns a size such as '
                    '200MB into one).')
            threshold, matched = found[0]['peak_engine'], match
        for policy in policies:
            name = f'dtr[{policy}]'
            if threshold is None:
                records.append(
                    self._skipped(name, 'dtr', policy,
                                  f'{match} has no peak to match'))
                bar.update()
                continue
            records.append(
                self.run(
                    name,
                    self.spec('dtr', threshold=int(threshold), policy=policy),
                    bar,
                    matched_to=matched))
        bar.close()
        return records

    def prime(self) -> None:
        """One throwaway baseline run before the measured ones.

        On a machine that has just been busy (or idle) the first runs are
        often slower; this run absorbs that. Its result is not kept.
        """
        bar = self.bar(1, 'priming run')
        spec = self.spec('baseline', steps=1, meter=False, profile=False)
        self.launcher.run(spec, 'priming')
        bar.update()
        bar.close()


#: The per-step figures of a run that a repeat round may change.
COUNTS = ('peak_engine', 'evictions', 'recomputations', 'eviction_failures')


def _counts(record: dict) -> dict:
    """A round's per-step figures (:data:`COUNTS`)."""
    return {key: record.get(key) for key in COUNTS}
