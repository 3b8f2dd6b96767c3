"""``results.json`` kept up to date, and the runs of a section that failed.

``results.json`` holds ``meta`` (machine and software, refreshed by every
invocation) and one section per benchmark that has run (``sweep``,
``compare``, ``largest_batch``), each with the ``settings`` it ran with and
its own ``machine`` (the ``meta`` of the invocation that wrote it).
Running one benchmark replaces its section and keeps the others, so the
table and the plots always show every section of the work dir.
"""
import json
import os
import os.path as osp
import platform
import subprocess
from typing import List, Sequence, Tuple

import torch

from .results import read_results


def machine_info(device: str) -> dict:
    """The machine and software the runs ran on.

    Args:
        device (str): The runs' device; a CUDA device adds ``gpu``.

    Returns:
        dict: ``cpu``, ``cpu_count``, ``torch_threads``, ``torch``,
        ``python``, ``platform``, ``device``, ``mmdtr`` (its version, and
        the commit of its git checkout where it runs from one, ``+dirty``
        with tracked files changed: a figure is tied to the engine that
        gave it; found by an adversarial search) and, where known,
        ``mmengine``, ``load_average`` and ``gpu``.
    """
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            names = [
                ln.split(':', 1)[1].strip() for ln in f
                if ln.startswith('model name')
            ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = dict(
        cpu=cpu,
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        device=device,
        mmdtr=_mmdtr_source())
    try:
        import mmengine
        info['mmengine'] = mmengine.__version__
    except ImportError:  # pragma: no cover - mmdtr requires it
        pass
    if hasattr(os, 'getloadavg'):
        info['load_average'] = [round(x, 2) for x in os.getloadavg()]
    if device.startswith('cuda') and torch.cuda.is_available():
        info['gpu'] = torch.cuda.get_device_name(torch.device(device))
    return info


def _git(root: str, *argv) -> str:
    """``git argv`` in ``root``: its output, or ``None`` if it failed."""
    try:
        done = subprocess.run(['git', *argv],
                              cwd=root,
                              capture_output=True,
                              text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git, or too slow
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _mmdtr_source() -> str:
    """mmdtr's version, with its checkout's commit where there is one (a
    worktree too; not another checkout it is installed in)."""
    from mmdtr import __version__
    root = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
    top = _git(root, 'rev-parse', '--show-toplevel')
    commit = _git(root, 'rev-parse', '--short=7', 'HEAD')
    if not top or not commit or osp.realpath(top) != osp.realpath(root):
        return __version__
    changed = _git(root, 'status', '--porcelain', '--untracked-files=no')
    return f"{__version__} ({commit}{'+dirty' if changed else ''})"


def update_results(path: str, meta: dict, section: str, data) -> dict:
    """Write ``data`` as ``section`` of the JSON at ``path``; return all.

    Args:
        path (str): The ``results.json`` file; its other sections are kept.
        meta (dict): Replaces ``meta`` (see :func:`machine_info`).
        section (str): The section's name, e.g. ``'sweep'``.
        data: The section's contents.

    Returns:
        dict: Everything written.

    Raises:
        MmdtrError: If an existing file is not a ``results.json`` of the
            benchmark (:func:`~.results.read_results`).
    """
    results = read_results(path)
    results['meta'] = meta
    results[section] = data
    return _write_results(path, results)


def drop_sections(path: str, sections: Sequence[str]) -> dict:
    """Remove ``sections`` from the JSON at ``path``; return all.

    Args:
        path (str): The ``results.json`` file.
        sections (Sequence[str]): Section names; those absent are skipped.

    Returns:
        dict: Everything written.

    Raises:
        MmdtrError: If an existing file is not a ``results.json`` of the
            benchmark (:func:`~.results.read_results`).
    """
    results = read_results(path)
    for section in sections:
        results.pop(section, None)
    return _write_results(path, results)


def _write_results(path: str, results: dict) -> dict:
    """Write ``results`` whole or not at all: a signal while dumping left
    a cut file, which the next command refused (found by a review)."""
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    part = f'{path}.part'
    with open(part, 'w') as f:
        json.dump(results, f, indent=2)
    os.replace(part, path)
    return results


def failed_runs(section: str, data: dict) -> Tuple[List[str], int]:
    """The runs of a section that failed, and how many it has.

    Sweep and compare runs fail when their status is neither ``'ok'`` nor
    ``'skipped'``; a skipped run (a fraction below one byte, nothing to
    match) is neither failed nor counted: the table says so (it was
    reported as a failure, with a log it does not have; found by an
    adversarial search). The
    largest-batch search of a technique fails when a probe fails otherwise
    than by not fitting.

    Args:
        section (str): ``'sweep'``, ``'compare'`` or ``'largest_batch'``.
        data (dict): The section: ``runs``, or for ``largest_batch`` its
            ``result``.

    Returns:
        tuple: ``(failed, total)``: a ``'name (status)'`` per failed run,
        and the number of runs not skipped (searches for
        ``largest_batch``).
    """
    if section == 'largest_batch':
        result = data['result']
        return [
            f'largest batch of {technique} ({result[technique]["error"]})'
            for technique in ('baseline', 'dtr')
            if result[technique].get('error')
        ], 2
    return [
        f"{run['name']} ({run['status']})" if run['status'] != 'ok' else
        f"{run['name']} ({run['lost_repeats']} repeat(s) failed)"
        for run in data['runs']
        if run['status'] not in ('ok', 'skipped') or run.get('lost_repeats')
    ], sum(run['status'] != 'skipped' for run in data['runs'])


def none_ran(section: str, data: dict) -> bool:
    """Whether no run of a section went through (every one not skipped
    failed; runs that lost a repeat went through): the commands after it
    are then not run. Counting those as failed stopped them after a sweep
    whose every run lost a repeat (found by a review).

    Args:
        section (str): ``'sweep'``, ``'compare'`` or ``'largest_batch'``.
        data (dict): The section, as for :func:`failed_runs`.
    """
    if section == 'largest_batch':
        return len(failed_runs(section, data)[0]) == 2
    ran = [r for r in data['runs'] if r['status'] != 'skipped']
    return bool(ran) and all(r['status'] != 'ok' for r in ran)


def failures_message(failures: List[str], total: int, not_run: Sequence[str],
                     work_dir: str) -> str:
    """What the tool says when runs failed (see :func:`failed_runs`).

    Args:
        failures (list[str]): The failed runs; the first five are named.
        total (int): The number of runs.
        not_run (Sequence[str]): The commands left out after a benchmark
            whose every run failed.
        work_dir (str): The work dir, whose ``logs`` the message names.

    Returns:
        str: The message.
    """
    shown = ', '.join(failures[:5])
    if len(failures) > 5:
        shown += f' and {len(failures) - 5} more'
    text = f'{len(failures)} of {total} runs failed: {shown}.'
    if not_run:
        text += (f' Every run of the last benchmark failed, so '
                 f'{", ".join(not_run)} did not run.')
    return text + (f' Their logs are in {osp.join(work_dir, "logs")}, and '
                   'the status column of benchmark.md says why.')
