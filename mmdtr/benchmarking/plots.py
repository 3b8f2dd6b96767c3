"""The benchmark's plots, drawn with matplotlib's Agg backend (no display).

- ``sweep.png``: step time and peak memory against DTR's threshold, with
  the baseline as horizontal lines;
- ``time_vs_peak.png``: step time against peak memory for every technique
  (the sweep's DTR runs joined by a line).
"""
from typing import List

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

from .report import never_evicts  # noqa: E402

MIB = 2**20
_MARKERS = dict(
    baseline='s',
    dispatch_floor='P',
    checkpoint_sqrt='^',
    mmengine_ac='v',
    mmdtr_ac='D',
    dtr='o')


def _ok(records: List[dict]) -> List[dict]:
    return [
        r for r in records
        if r.get('status') == 'ok' and r.get('median_step_s') is not None
        and r.get('peak_engine') is not None and not r.get('lost_repeats')
    ]  # as the table: a run that lost a round has no ratio there


def _finite_dtr(records: List[dict]) -> List[dict]:
    return sorted(
        (r for r in _ok(records) if r['technique'] == 'dtr'
         and r.get('threshold') and not never_evicts(r['threshold'])),
        key=lambda r: r['threshold'])


def plot_sweep(records: List[dict], path: str) -> str:
    """Step time and peak memory against the threshold; returns ``path``.

    Args:
        records (list[dict]): The sweep's run records; the successful DTR
            runs at a threshold are plotted, the baseline, the dispatch
            floor and DTR without eviction drawn as horizontal lines.
        path (str): The PNG file to write.

    Returns:
        str: ``path``.
    """
    points = _finite_dtr(records)
    fig, (ax_time, ax_peak) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [r['threshold'] / MIB for r in points]
    ax_time.plot(x, [r['median_step_s'] for r in points], 'o-', label='DTR')
    ax_peak.plot(
        x, [r['peak_engine'] / MIB for r in points],
        'o-',
        label='DTR, engine meter')
    ax_peak.plot(
        x, [(r.get('peak_independent') or float('nan')) / MIB for r in points],
        'x--',
        label='DTR, independent meter')
    ax_peak.plot(x, x, ':', color='gray', label='peak = threshold')
    for r in _ok(records):
        if r['technique'] == 'baseline':
            ax_time.axhline(
                r['median_step_s'], color='k', ls='--', label='baseline')
            ax_peak.axhline(
                r['peak_engine'] / MIB, color='k', ls='--', label='baseline')
        elif r['technique'] == 'dispatch_floor':
            ax_time.axhline(
                r['median_step_s'],
                color='tab:gray',
                ls='-.',
                label='dispatch floor')
        elif r['technique'] == 'dtr' and never_evicts(r.get('threshold')):
            ax_time.axhline(
                r['median_step_s'],
                color='tab:green',
                ls=':',
                label='DTR, no eviction')
    ax_time.set(
        xlabel='threshold (MiB)',
        ylabel='step time, median (s)',
        title='Step time')
    ax_peak.set(
        xlabel='threshold (MiB)',
        ylabel='peak memory (MiB)',
        title='Peak memory')
    for ax in (ax_time, ax_peak):
        ax.grid(alpha=0.3)
        ax.legend(fontsize='small')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_time_vs_peak(results: dict, path: str) -> str:
    """Step time against engine-metered peak, every technique.

    Args:
        results (dict): The contents of ``results.json``; its ``sweep`` and
            ``compare`` runs are plotted.
        path (str): The PNG file to write.

    Returns:
        str: ``path``.
    """
    fig, ax = plt.subplots(figsize=(7, 4.8))
    sweep = results.get('sweep', {}).get('runs', [])
    line = _finite_dtr(sweep)
    if line:
        ax.plot([r['peak_engine'] / MIB for r in line],
                [r['median_step_s'] for r in line],
                'o-',
                color='tab:blue',
                alpha=0.6,
                label='DTR sweep')
    for r in _ok(results.get('compare', {}).get(
            'runs', [])) + [r for r in _ok(sweep) if r not in line]:
        marker = _MARKERS.get(r['technique'], 'o')
        if r['technique'] == 'dtr' and never_evicts(r.get('threshold')):
            marker = '*'
        ax.plot(
            r['peak_engine'] / MIB,
            r['median_step_s'],
            marker,
            ms=8,
            label=r['name'])
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize='small')
    ax.set(
        xlabel='peak memory, engine meter (MiB)',
        ylabel='step time, median (s)',
        title='Time against memory')
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
