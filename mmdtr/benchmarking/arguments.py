"""Checks of ``tools/benchmark.py``'s values: the device, the numbers, DTR
thresholds and ``--match``.

Each check raises one :class:`~mmdtr.errors.MmdtrError` naming the flag,
the value and what is accepted; :mod:`.command_line` runs them.
"""
import math
from typing import Union

import torch

from mmdtr.core.sizes import parse_size
from mmdtr.errors import MmdtrError
from .suite import ALTERNATIVES

#: Integer flags (``argparse`` dests) and the least value each accepts.
AT_LEAST = dict(
    batch_size=1,
    image_size=1,
    seq_len=1,
    warmup=0,
    steps=1,
    repeats=1,
    threads=1,
    max_batch=1,
    start_batch=1)
#: The longest ``--timeout``: waits on a run's result take at most
#: 2**31 - 1 milliseconds, less the grace a run gets after its timeout.
MAX_TIMEOUT_S = 2_000_000
#: The seeds ``torch.manual_seed`` takes.
SEEDS = (-2**63, 2**64 - 1)


def check_device(device: str) -> str:
    """``--device`` checked: ``'auto'``, ``'cpu'``, ``'cuda'``, ``'cuda:N'``.

    Args:
        device (str): The flag's value.

    Returns:
        str: The device; ``'auto'`` resolved, a CPU device as ``'cpu'``.

    Raises:
        MmdtrError: If ``torch.device`` refuses it, it is neither a CPU nor
            a CUDA device, or it names CUDA (or a CUDA index) the machine
            does not have.
    """
    if device == 'auto':
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ('cpu', 'cuda'):
        raise MmdtrError(
            f'--device {device!r} is not accepted; accepted: cpu, cuda, '
            'cuda:N (N a device index) or auto.',
            hint='e.g. --device cpu.')
    if parsed.type == 'cpu':
        return 'cpu'
    if not torch.cuda.is_available():
        raise MmdtrError(
            f'--device {device}: CUDA is not available.',
            hint='use --device cpu.')
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise MmdtrError(
            f'--device {device}: this machine has {count} CUDA device(s), '
            f'cuda:0 to cuda:{count - 1}.',
            hint='give one of those, or --device cuda.')
    return device


def check_numbers(args) -> None:
    """Check the integer flags, ``--timeout``, ``--seed``, ``--fractions``.

    Args:
        args (argparse.Namespace): The parsed arguments.

    Raises:
        MmdtrError: On the first value out of its range.
    """
    for dest, least in AT_LEAST.items():
        value = getattr(args, dest)
        if value is not None and value < least:
            flag = '--' + dest.replace('_', '-')
            raise MmdtrError(
                f'{flag} {value} must be at least {least}.',
                hint=f'give {flag} {least} or more, or leave it out for '
                'its default.')
    if args.timeout is not None and not (math.isfinite(args.timeout) and
                                         0 < args.timeout <= MAX_TIMEOUT_S):
        raise MmdtrError(
            f'--timeout {args.timeout:.15g} is not accepted: give a positive '
            f'number of seconds per run, at most {MAX_TIMEOUT_S} (what a '
            'run can wait on its result).',
            hint='leave --timeout out for no limit.')
    if not SEEDS[0] <= args.seed <= SEEDS[1]:
        raise MmdtrError(
            f'--seed {args.seed} is out of the range '
            f'{SEEDS[0]} to {SEEDS[1]} that torch accepts.',
            hint='give a seed in that range, e.g. --seed 0 (the default).')
    for fraction in args.fractions or ():
        if not (math.isfinite(fraction) and 0 < fraction <= 1):
            raise MmdtrError(
                f'--fractions {fraction:g} is not accepted: fractions of the '
                'peak of DTR without eviction must be in (0, 1].',
                hint='e.g. --fractions 0.9 0.7 0.5 0.3 0.25; give sizes '
                'with --thresholds.')


def check_threshold(threshold: int, flag: str, value: str,
                    device: str) -> None:
    """Refuse DTR threshold 0 (evict on CUDA out-of-memory) off CUDA.

    Args:
        threshold (int): The threshold in bytes.
        flag (str): The flag it came from.
        value (str): The flag's value as given.
        device (str): The checked ``--device``.

    Raises:
        MmdtrError: If ``threshold`` is 0 and ``device`` is the CPU.
    """
    if threshold == 0 and device == 'cpu':
        raise MmdtrError(
            f'{flag} {value}: a threshold of 0 means evicting on CUDA '
            'out-of-memory errors; on CPU DTR needs a threshold above 0.',
            hint='give a size, e.g. 200MB.')


def parse_match(value: str) -> Union[str, int]:
    """``--match``: a technique of :data:`.ALTERNATIVES`, or bytes.

    Args:
        value (str): The flag's value.

    Returns:
        str | int: The technique's name, or the size in bytes.

    Raises:
        MmdtrError: If ``value`` is neither.
    """
    if value in ALTERNATIVES:
        return value
    try:
        return parse_size(value, '--match')
    except MmdtrError:
        raise MmdtrError(
            f'--match {value!r} is neither a technique of '
            f'{list(ALTERNATIVES)} nor a size.',
            hint='e.g. --match mmdtr_ac or --match 200MB.') from None
