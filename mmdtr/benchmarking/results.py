"""Read a work dir's ``results.json``, refusing one the tool did not write.

``tools/benchmark.py`` adds its sections to the ``results.json`` it finds,
and ``report`` draws from it alone, so a file that is not JSON, or not laid
out as :mod:`.results_updates` writes it, is refused up front with one
:class:`~mmdtr.errors.MmdtrError` instead of a traceback after the runs.
"""
import json
import os.path as osp
from numbers import Number

from mmdtr.errors import MmdtrError

#: The top-level keys of ``results.json``.
SECTIONS = ('meta', 'sweep', 'compare', 'largest_batch')
#: Keys a run record must have, with their types.
_RUN_KEYS = dict(name=str, technique=str, status=str)
#: Keys of a run record that, when set, are numbers.
_RUN_NUMBERS = ('threshold', 'fraction', 'batch_size', 'median_step_s',
                'peak_engine', 'peak_independent', 'evictions',
                'recomputations', 'eviction_failures', 'ops')
_BATCH_KEYS = ('capacity', 'max_batch', 'policy', 'headroom', 'criterion',
               'baseline', 'dtr')


def _check(ok: bool, path: str, where: str, what: str) -> None:
    if not ok:
        raise MmdtrError(
            f'{path} is not a results.json of tools/benchmark.py: {where} '
            f'{what}.',
            hint='give another --work-dir, or move the file away (the '
            'benchmark adds its sections to the results.json it finds).')


def _is(value, kind) -> bool:
    if kind is Number:  # bool is an int; not a measurement
        return isinstance(value, Number) and not isinstance(value, bool)
    return isinstance(value, kind)


def _check_runs(runs, path: str, where: str) -> None:
    _check(isinstance(runs, list), path, where, 'is not a list')
    for i, run in enumerate(runs):
        at = f'{where}[{i}]'
        _check(isinstance(run, dict), path, at, 'is not an object')
        for key, kind in _RUN_KEYS.items():
            _check(
                _is(run.get(key), kind), path, f'{at}.{key}',
                f'is not a {kind.__name__}')
        for key in _RUN_NUMBERS:
            value = run.get(key)
            _check(
                value is None or _is(value, Number), path, f'{at}.{key}',
                'is not a number')
        steps = run.get('step_times_s') or []
        _check(
            isinstance(steps, list) and all(_is(t, Number) for t in steps),
            path, f'{at}.step_times_s', 'is not a list of numbers')


def _check_largest_batch(section: dict, path: str) -> None:
    data = section.get('result')
    _check(
        isinstance(data, dict), path, 'largest_batch.result',
        'is not an object')
    missing = [key for key in _BATCH_KEYS if key not in data]
    _check(not missing, path, 'largest_batch.result', f'lacks {missing}')
    for key in ('capacity', 'headroom'):
        _check(
            _is(data[key], Number), path, f'largest_batch.result.{key}',
            'is not a number')
    for technique in ('baseline', 'dtr'):
        where = f'largest_batch.result.{technique}'
        entry = data[technique]
        _check(
            isinstance(entry, dict) and 'largest_batch' in entry, path, where,
            'is not an object with largest_batch and probes')
        probes = entry.get('probes')
        _check(
            isinstance(probes, list), path, f'{where}.probes', 'is not a list')
        for i, probe in enumerate(probes):
            _check(
                isinstance(probe, dict) and 'batch_size' in probe
                and 'fits' in probe, path, f'{where}.probes[{i}]',
                'is not an object with batch_size and fits')
            for key in ('peak_engine', 'peak_independent'):
                value = probe.get(key)
                _check(
                    value is None or _is(value, Number), path,
                    f'{where}.probes[{i}].{key}', 'is not a number')


def check_results(results, path: str = 'results.json') -> None:
    """Check that ``results`` is laid out as :mod:`.results_updates` writes it.

    Args:
        results: The parsed JSON.
        path (str): Its file, for the message.

    Raises:
        MmdtrError: Naming the first part that is not as written.
    """
    _check(
        isinstance(results, dict), path, 'the top level', 'is not an object')
    unknown = sorted(set(results) - set(SECTIONS))
    _check(not unknown, path, 'the top level',
           f'has keys {unknown}; accepted: {list(SECTIONS)}')
    for name in SECTIONS:
        if name not in results:
            continue
        section = results[name]
        _check(isinstance(section, dict), path, name, 'is not an object')
        if name == 'meta':
            continue
        _check(
            isinstance(section.get('settings'), dict), path,
            f'{name}.settings', 'is not an object')
        if name == 'largest_batch':
            _check_largest_batch(section, path)
        else:
            _check_runs(section.get('runs'), path, f'{name}.runs')
    if 'compare' in results:
        _check('match' in results['compare']['settings'], path,
               'compare.settings', 'has no match')


def read_results(path: str) -> dict:
    """The checked contents of ``results.json`` at ``path``; ``{}`` if none.

    Args:
        path (str): The file.

    Returns:
        dict: Its contents, or ``{}`` if the file does not exist.

    Raises:
        MmdtrError: If the file cannot be read, is not JSON, or is not laid
            out as the benchmark writes it.
    """
    if not osp.exists(path):
        return {}
    try:
        with open(path) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        raise MmdtrError(
            f'{path} cannot be read as JSON: {e}',
            hint='give another --work-dir, or move the file away (the '
            'benchmark adds its sections to the results.json it '
            'finds).') from e
    check_results(results, path)
    return results
