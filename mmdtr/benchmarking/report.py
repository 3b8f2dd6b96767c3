"""What the benchmark draws from ``results.json``: ``benchmark.md``, plots.

:func:`markdown` renders the tables of every section;
:func:`write_report` writes them and the plots to the work dir.
:mod:`.results_updates` writes ``results.json`` itself.
"""
import os.path as osp
from typing import List, Optional

from mmdtr.core.sizes import format_size

#: Slowdown targets of the engine issue (ResNet-50 CPU step, batch >= 8):
#: ``None`` is a threshold above the peak (no eviction).
TARGETS = {None: 1.05, 0.5: 1.15, 0.25: 1.35}
# Settings that apply to largest-batch probes (they set batch and steps).
_PROBE_KEYS = ('config', 'image_size', 'seq_len', 'device', 'optimizer')


def never_evicts(threshold: Optional[int]) -> bool:
    """Whether a run's threshold is one no workload reaches (2**60 bytes or
    more, :data:`~.workloads.NO_EVICTION` among them): its engine metered,
    evicting nothing by design. ``None`` (no threshold: eviction when a CUDA
    allocation fails) and 0 are not."""
    return threshold is not None and threshold >= 2**60


def _mib(nbytes) -> str:
    return '-' if nbytes is None else f'{nbytes / 2**20:.1f}'


def _num(value, fmt: str = '.1f') -> str:
    return '-' if value is None else format(value, fmt)


def _threshold(record: dict) -> str:
    threshold = record.get('threshold')
    if record['technique'] != 'dtr' or threshold is None:
        return '-'
    if never_evicts(threshold):
        return 'none reached'
    text = format_size(threshold)
    if record.get('fraction') is not None:
        text += f" ({record['fraction']:g}x peak)"
    return text


def _slowdown(record: dict, base: Optional[float]) -> Optional[float]:
    """Median step over the baseline's, for a run that succeeded (a failed
    run keeps the steps it timed before it failed; found by an audit)."""
    step = _step(record, fastest=False)
    return step / base if step is not None and base else None


def _best_slowdown(record: dict, base: Optional[dict]) -> Optional[float]:
    """Fastest step over the baseline's fastest: the least disturbed pair
    of steps, a steadier estimate of the overhead on a shared machine."""
    step, base_step = _step(record, True), _step(base, True)
    return step / base_step if step and base_step else None


def targets_apply(settings: dict) -> bool:
    """Whether the issue's targets are defined for a sweep: a ResNet-50
    training step on CPU, batch 8 or more, DTR's own policy (an audit found
    them on every sweep, a GPU's and GPT's too).

    Args:
        settings (dict): The sweep's settings.

    Returns:
        bool: True for a CPU sweep of the shipped ResNet-50 config (no
        ``--cfg-options`` on ``model``), batch 8 or more, policy ``'dtr'``,
        a training step with its SGD step (``--optimizer sgd``) timed after
        a warm-up (``--optimizer none`` or ``--warmup 0`` were marked too;
        a review).
    """
    return (
        str(settings.get('device') or 'cpu').startswith('cpu')
        and settings.get('policy', 'dtr') == 'dtr'
        and settings.get('optimizer', 'sgd') == 'sgd'
        and (settings.get('warmup', 1) or 0) >= 1
        and (settings.get('batch_size') or 0) >= 8
        and 'resnet50' in osp.basename(str(settings.get('config')))
        # the config as shipped: an option on the model (depth=18)
        # makes it another workload (a review)
        and not any(
            str(key).startswith('model')
            for key in settings.get('cfg_options') or ()))


def _not_held(record: dict) -> bool:
    """Whether a DTR run with a threshold failed to evict in any round:
    a later round that failed was pooled into the times (found by a
    review), and the status read the first round's only (another)."""
    threshold = record.get('threshold')
    return bool(threshold) and not never_evicts(threshold) and bool(
        record.get('eviction_failures') or any(
            r.get('eviction_failures')
            for r in record.get('round_counts') or ()))


def _counts(record: dict) -> str:
    """The evictions, recomputations and eviction failures cells: ``-`` for
    a run without DTR, whose counts come from a metering step under an
    engine that never evicts (0.0 read as if checkpointing recomputed
    nothing; a review)."""
    if record['technique'] != 'dtr':
        return '- | - | -'
    return ' | '.join(
        _num(record.get(key))
        for key in ('evictions', 'recomputations', 'eviction_failures'))


def _target(record: dict, slowdown: Optional[float]) -> str:
    if record['technique'] != 'dtr':
        return ''
    key = None if never_evicts(record.get('threshold')) else record.get(
        'fraction', 'other')
    if key not in TARGETS:
        return ''
    if slowdown is None:
        return f'<= {TARGETS[key]}x: -'
    if key is not None and _not_held(record):
        # nothing evictable was left at times: the run did not keep to the
        # threshold, so its time says nothing of one that did
        return f'<= {TARGETS[key]}x: - (threshold not held)'
    met = 'met' if slowdown <= TARGETS[key] else 'missed'
    return f'<= {TARGETS[key]}x: {met}'


def _run_table(records: List[dict], extra: str) -> List[str]:
    """``extra``: ``'target'`` (the issue's targets), ``''`` (a sweep they
    are not defined for) or ``'what'`` (compare's applied techniques)."""
    base_record = next((r for r in records if r['technique'] == 'baseline'),
                       None)
    base = _step(base_record, fastest=False)
    head = ('| run | threshold | peak, engine (MiB) | peak, independent '
            '(MiB) | step (s, median) | vs baseline | fastest vs fastest | '
            'evictions | recomputations | eviction failures | ' +
            (extra + ' | ' if extra else '') + 'status |')
    lines = [head, '|' + ' --- |' * len(head.strip('|').split('|'))]
    for r in records:
        slowdown = _slowdown(r, base)
        best = _best_slowdown(r, base_record)
        extra_cell = (
            _target(r, slowdown)
            if extra == 'target' else r.get('applied') or '')
        status = r['status'] + (f": {r['error']}" if r.get('error') else '')
        if r['technique'] == 'dtr' and _not_held(r):
            status += ' (threshold not held: nothing evictable at times)'
        if r.get('lost_repeats'):
            status += f" ({r['lost_repeats']} repeat(s) failed, not pooled)"
        if r.get('round_counts'):
            status += ' (per round: ' + _rounds(r['round_counts']) + ')'
        lines.append(
            f"| {r['name']} | {_threshold(r)} | {_mib(r.get('peak_engine'))}"
            f" | {_mib(r.get('peak_independent'))} | "
            f"{_num(r.get('median_step_s'), '.3f')} | "
            f"{_num(slowdown, '.2f')}{'x' if slowdown else ''} | "
            f"{_num(best, '.2f')}{'x' if best else ''} | "
            f'{_counts(r)} | '
            f"{extra_cell + ' | ' if extra else ''}"
            f"{status.replace('|', '/')} |")
    return lines


def _rounds(round_counts: list) -> str:
    """The figures that differ between repeat rounds, each round's in
    order: ``'evictions 42/44'`` (the table shows the first round's)."""
    varied = [
        key for key in round_counts[0] if any(
            r.get(key) != round_counts[0].get(key) for r in round_counts)
    ]
    return '; '.join(f"{key.replace('_', ' ')} " + '/'.join(
        _mib(r.get(key)) if key == 'peak_engine' else _num(r.get(key))
        for r in round_counts) for key in varied)


def _step(record: Optional[dict], fastest: bool) -> Optional[float]:
    """A run's median or fastest step, if it succeeded in every round (one
    pooled from fewer rounds undoes the interleaving; a review)."""
    if record is None or record.get('status') != 'ok' or \
            record.get('lost_repeats'):
        return None
    if fastest:
        return min(record.get('step_times_s') or (), default=None)
    return record.get('median_step_s')


def per_op_line(records: List[dict]) -> Optional[str]:
    """The sweep's cost per op: the dispatch floor over the baseline, and
    DTR without eviction over the floor (medians, then fastest steps), or
    ``None`` without those three runs or an op count.

    Args:
        records (list[dict]): The sweep's run records.

    Returns:
        str | None: The sentence, in microseconds per op.
    """
    first = {}
    for r in records:
        if r['technique'] == 'dtr' and not never_evicts(r.get('threshold')):
            continue
        first.setdefault(r['technique'], r)
    runs = [first.get(t) for t in ('baseline', 'dispatch_floor', 'dtr')]
    ops = runs[2].get('ops') if runs[2] else None
    if not ops or None in runs:
        return None
    cells = []
    for fastest in (False, True):
        base, floor, dtr = (_step(r, fastest) for r in runs)
        if None in (base, floor, dtr):
            return None
        cells.append(f'{(floor - base) / ops * 1e6:.1f} us and '
                     f'{(dtr - floor) / ops * 1e6:.1f} us')
    return (f'Per op ({ops:.0f} ops per step in scope): the dispatch floor '
            'over the baseline, and DTR without eviction over the floor: '
            f'{cells[0]} (medians); {cells[1]} (fastest steps).')


def _settings_line(
    settings: dict,
    keys=('config', 'batch_size', 'image_size', 'seq_len', 'device', 'warmup',
          'steps', 'repeats', 'optimizer', 'threads')
) -> str:
    return ', '.join(f'{k}={settings.get(k)}' for k in keys
                     if settings.get(k) is not None)


def _machine(meta: dict) -> str:
    """The machine line of a ``meta`` (:func:`~.results_updates.
    machine_info`)."""
    source = f", mmdtr {meta['mmdtr']}" if meta.get('mmdtr') else ''
    return (f"{meta.get('cpu')} ({meta.get('cpu_count')} CPUs), torch "
            f"{meta.get('torch')}, mmengine {meta.get('mmengine')}{source}, "
            f"device {meta.get('device')}"
            f"{', ' + meta['gpu'] if meta.get('gpu') else ''}; load average "
            f"at start {meta.get('load_average')}.")


def _own_machine(section: dict, meta: dict) -> List[str]:
    """A section's machine line where an earlier invocation into the same
    work dir wrote it on another machine or software than the latest."""
    own = section.get('machine')
    if own is None or own == meta:
        return []
    return [f'Machine of this section: {_machine(own)}', '']


def markdown(results: dict) -> str:
    """The tables of every section of ``results``.

    Args:
        results (dict): The contents of ``results.json``.

    Returns:
        str: ``benchmark.md``'s Markdown.
    """
    meta = results.get('meta', {})
    lines = [
        '# Benchmark', '', f'Machine: {_machine(meta)}', '',
        'Peaks: engine = the DTR engine\'s meter (runs without DTR: one '
        'extra step under an engine that never evicts); independent = '
        'torch.profiler memory events (CPU) or '
        'torch.cuda.max_memory_allocated (CUDA). Evictions, recomputations '
        'and eviction failures are per timed step, of DTR runs only ("-" '
        'for the others: checkpointing\'s recomputation is not counted).', ''
    ]
    if 'sweep' in results:
        section = results['sweep']
        lines += [
            '## Threshold sweep', '', *_own_machine(section, meta),
            _settings_line(section['settings']) +
            f", policy={section['settings'].get('policy')}", ''
        ]
        apply = targets_apply(section['settings'])
        lines += _run_table(section['runs'], 'target' if apply else '')
        lines += [''] if apply else [
            '', "The issue's targets (a ResNet-50 training step with SGD on "
            "CPU, batch 8 or more, DTR's policy, timed after a warm-up) "
            'are not defined for this sweep.', ''
        ]
        per_op = per_op_line(section['runs'])
        if per_op:
            lines += [per_op, '']
    if 'compare' in results:
        section = results['compare']
        lines += [
            '## Alternatives at the same memory', '',
            *_own_machine(section, meta),
            _settings_line(section['settings']) +
            f", DTR threshold matched to {section['settings']['match']}", ''
        ]
        lines += _run_table(section['runs'], 'what') + ['']
    if 'largest_batch' in results:
        section = results['largest_batch']
        data = section['result']
        cuda = str(section['settings'].get('device')).startswith('cuda')
        lines += [
            '## Largest batch', '', *_own_machine(section, meta),
            _settings_line(section['settings'], _PROBE_KEYS) +
            f", capacity={format_size(data['capacity'])}, "
            f"batches {data.get('start_batch', 1)} to {data['max_batch']}, "
            f"policy={data['policy']}, "
            f"DTR threshold=capacity - {format_size(data['headroom'])}; "
            f"fits: {data['criterion']}.", '',
            '| technique | largest batch | peak at it (MiB, '
            f"{'max_memory_allocated' if cuda else 'engine'}) | "
            'batches tried (fits) |', '| --- | --- | --- | --- |'
        ]
        for technique in ('baseline', 'dtr'):
            entry = data[technique]
            best = entry['largest_batch']
            peaks = [
                p['peak_independent'] if cuda else p['peak_engine']
                for p in entry['probes']
                if p['batch_size'] == best and p['fits']
            ]
            tried = ', '.join(
                f"{p['batch_size']} ({'yes' if p['fits'] else 'no'})"
                for p in entry['probes'])
            if entry.get('error'):
                best = f"failed ({entry['error']})".replace('|', '/')
            lines.append(f'| {technique} | {best} | '
                         f'{_mib(peaks[0] if peaks else None)} | {tried} |')
        lines.append('')
    return '\n'.join(lines)


def write_report(results: dict, work_dir: str) -> List[str]:
    """Write ``benchmark.md`` and the plots; return the paths written.

    The plots need matplotlib; ``sweep.png`` is drawn when there is a
    sweep, ``time_vs_peak.png`` when there is a sweep or a compare.

    Args:
        results (dict): The contents of ``results.json``.
        work_dir (str): Where the files go.

    Returns:
        list[str]: The paths written.
    """
    from .plots import plot_sweep, plot_time_vs_peak
    path = osp.join(work_dir, 'benchmark.md')
    with open(path, 'w') as f:
        f.write(markdown(results))
    written = [path]
    if 'sweep' in results:
        written.append(
            plot_sweep(results['sweep']['runs'],
                       osp.join(work_dir, 'sweep.png')))
    if 'sweep' in results or 'compare' in results:
        written.append(
            plot_time_vs_peak(results, osp.join(work_dir, 'time_vs_peak.png')))
    return written
