"""``tools/benchmark.py``'s command line: its commands and options, parsed,
then checked before anything runs.

:func:`parse_args` parses; :func:`check_args` refuses bad or inapplicable
arguments with one :class:`~mmdtr.errors.MmdtrError` (the value checks
are :mod:`.arguments`'s); :func:`quick_default` and :func:`max_batch` give
the values ``--quick`` sets.
"""
import argparse

from mmdtr.core.policies import POLICIES
from mmdtr.core.sizes import parse_size
from mmdtr.errors import MmdtrError
from mmdtr.utils.cfg_options import CfgOptionsAction
from .arguments import (check_device, check_numbers, check_threshold,
                        parse_match)
from .launch import LAUNCHERS
from .suite import ALTERNATIVES
from .workloads import OPTIMIZERS

#: The tool's commands; ``all`` runs the first three.
COMMANDS = ('sweep', 'compare', 'largest-batch', 'all', 'report')
#: sweep's thresholds as fractions of the peak, without --fractions.
DEFAULT_FRACTIONS = (0.9, 0.7, 0.5, 0.3, 0.25)
#: --quick: tiny inputs, one warm-up and one measured step.
QUICK = dict(
    batch_size=2,
    image_size=64,
    seq_len=32,
    warmup=1,
    steps=1,
    fractions=(0.5, 0.25),
    max_batch=4)


class _Parser(argparse.ArgumentParser):
    """argparse's errors as one MmdtrError line (usage and exit 2 before;
    found by an audit)."""

    def error(self, message):
        raise MmdtrError(
            f'{message}.', hint='see python tools/benchmark.py --help.')


def parse_args(argv=None) -> argparse.Namespace:
    """``tools/benchmark.py``'s arguments, parsed (not yet checked).

    Args:
        argv (list, optional): The arguments; by default ``sys.argv``'s.

    Returns:
        argparse.Namespace: The arguments, with ``defaults``: the parser's
        default of each option that only some commands read.

    Raises:
        MmdtrError: If argparse refuses them.
    """
    parser = _Parser(description='Benchmark DTR against its alternatives')
    parser.add_argument('config', help='workload config file')
    parser.add_argument('command', choices=COMMANDS)
    parser.add_argument(
        '--work-dir', help='default: '
        'work_dirs/benchmark/<config name>')
    parser.add_argument(
        '--quick',
        action='store_true',
        help='tiny inputs, 1 warm-up + 1 measured step')
    work = parser.add_argument_group('workload')
    work.add_argument('--batch-size', type=int, help="default: the config's")
    work.add_argument('--image-size', type=int, help='image datasets')
    work.add_argument('--seq-len', type=int, help='token datasets')
    work.add_argument('--cfg-options', nargs='+', action=CfgOptionsAction)
    work.add_argument(
        '--device',
        default='auto',
        help="'cpu', 'cuda', 'cuda:N' or 'auto' (default)")
    work.add_argument('--warmup', type=int, help='default 1')
    work.add_argument('--steps', type=int, help='measured steps, default 3')
    work.add_argument(
        '--repeats',
        type=int,
        default=1,
        help='sweep: run every configuration this many times, in rounds, '
        'pooling the measured steps (default 1)')
    work.add_argument('--optimizer', choices=OPTIMIZERS, default='sgd')
    work.add_argument(
        '--blocks',
        help='glob of the blocks checkpointed by '
        'the alternatives, e.g. "backbone.layer*.*"')
    work.add_argument('--threads', type=int, help='torch threads per run')
    work.add_argument('--seed', type=int, default=0)
    dtr = parser.add_argument_group('DTR')
    dtr.add_argument(
        '--fractions',
        type=float,
        nargs='+',
        help='sweep thresholds as fractions of the peak; default '
        f'{" ".join(map(str, DEFAULT_FRACTIONS))} (--quick: '
        f'{" ".join(map(str, QUICK["fractions"]))}), none with --thresholds')
    dtr.add_argument(
        '--thresholds',
        nargs='+',
        default=[],
        help="sweep thresholds as sizes, e.g. 200MB")
    dtr.add_argument(
        '--policy',
        default='dtr',
        choices=sorted(POLICIES),
        help='policy of the sweep and largest batch')
    dtr.add_argument(
        '--policies',
        nargs='+',
        choices=sorted(POLICIES),
        default=list(POLICIES),
        help='policies to compare')
    dtr.add_argument(
        '--match',
        default='checkpoint_sqrt',
        help='DTR threshold of compare: the peak of one of '
        f'{", ".join(ALTERNATIVES)}, or a size')
    dtr.add_argument('--evictee-minimum-size', default='1MB')
    dtr.add_argument('--sqrt-sampling', action='store_true')
    dtr.add_argument(
        '--recording',
        default='auto',
        choices=('auto', 'always'),
        help="DTR's recording_threshold: 'auto' as DTRHook's default "
        '(after steps that evicted nothing, the next runs its ops '
        'unrecorded until memory passes their highest peak, at most half '
        "the threshold), 'always': every op recorded, as "
        'recording_threshold=None (default auto)')
    batch = parser.add_argument_group('largest batch')
    batch.add_argument(
        '--capacity',
        help="memory capacity, e.g. '1GB' "
        "('11GB' emulates a 2080Ti on a bigger card)")
    batch.add_argument('--max-batch', type=int, help='default 1024')
    batch.add_argument(
        '--start-batch',
        type=int,
        help='first batch tried (default 1); DTR starts at the larger of '
        "this and the baseline's largest")
    batch.add_argument(
        '--headroom',
        default='0',
        help='DTR runs at threshold capacity - headroom (default 0)')
    run = parser.add_argument_group('runs')
    run.add_argument(
        '--launcher',
        choices=LAUNCHERS,
        help='default: forkserver on CPU where available, else subprocess')
    run.add_argument('--timeout', type=float, help='seconds per run')
    run.add_argument('--no-progress', action='store_true')
    run.add_argument(
        '--no-prime',
        action='store_true',
        help='skip the throwaway run before the measured ones '
        '(always skipped with --quick)')
    args = parser.parse_args(argv)
    # what "given" means for the options another command reads: not the
    # parser's default (_refuse_unused)
    args.defaults = {
        dest: parser.get_default(dest)
        for dests in _ONLY_FOR.values()
        for dest in dests
    }
    return args


def quick_default(value, quick_key, args, normal):
    """``value`` if given, else ``QUICK[quick_key]`` under ``--quick``, else
    ``normal``.

    Args:
        value: The flag's value, None when not given.
        quick_key (str): The key of :data:`QUICK`.
        args (argparse.Namespace): The parsed arguments (``args.quick``).
        normal: The default without ``--quick``.

    Returns:
        The value to use.
    """
    if value is not None:
        return value
    return QUICK[quick_key] if args.quick else normal


def max_batch(args) -> int:
    """The largest batch largest-batch tries.

    Args:
        args (argparse.Namespace): The parsed arguments.

    Returns:
        int: ``--max-batch``, else ``QUICK['max_batch']`` under
        ``--quick``, else 1024.
    """
    return quick_default(args.max_batch, 'max_batch', args, 1024)


def check_args(args) -> None:
    """Reject bad arguments before anything runs; resolve ``--device``.

    Args:
        args (argparse.Namespace): From :func:`parse_args`; its ``device``
            is replaced by :func:`check_device`'s.

    Raises:
        MmdtrError: On the first bad or inapplicable argument.
    """
    args.device = check_device(args.device)
    check_numbers(args)
    parse_size(args.evictee_minimum_size, '--evictee-minimum-size')
    # checked whatever the command, so that a typo is never ignored
    headroom = parse_size(args.headroom, '--headroom')
    capacity = None if args.capacity is None else parse_size(
        args.capacity, '--capacity')
    match = parse_match(args.match)
    if args.command in ('largest-batch', 'all'):
        if args.capacity is None and not args.quick:
            raise MmdtrError(
                f'{args.command} needs --capacity, e.g. 1GB.',
                hint='give the memory the batch must fit in, e.g. '
                "--capacity 11GB; or add --quick, which takes a quarter "
                "above the baseline's peak.")
        if capacity == 0:
            raise MmdtrError(
                f'--capacity {args.capacity} must be above 0.',
                hint='e.g. --capacity 1GB.')
        if capacity is not None and headroom >= capacity:
            raise MmdtrError(
                f'--headroom {args.headroom} leaves no room in '
                f'--capacity {args.capacity}.',
                hint='give a --headroom below --capacity (DTR runs at '
                'threshold capacity - headroom), or a larger --capacity.')
        largest = max_batch(args)
        quick_max = args.max_batch is None and args.quick
        if args.start_batch is not None and args.start_batch > largest:
            raise MmdtrError(
                f'--start-batch {args.start_batch} is above the largest '
                f'batch tried, {largest} (--max-batch'
                f"{', as --quick sets it' if quick_max else ''}"
                ').',
                hint='give a smaller --start-batch or a larger --max-batch.')
    if args.command in ('compare', 'all'):
        if isinstance(match, int):
            check_threshold(match, '--match', args.match, args.device)
    for threshold in args.thresholds:
        check_threshold(
            parse_size(threshold, '--thresholds'), '--thresholds', threshold,
            args.device)
    _refuse_unused(args)


#: command -> the options (dests) only it reads, of those ``all`` runs;
#: ``--policy`` is read by sweep and largest-batch, not compare
_ONLY_FOR = {
    # --repeats too: compare ran each configuration once while its records
    # read as pooled (found by a review)
    'sweep': ('fractions', 'thresholds', 'repeats'),
    'compare': ('match', 'policies'),
    'largest-batch': ('capacity', 'max_batch', 'start_batch', 'headroom'),
    'sweep and largest-batch': ('policy', ),
}


def _refuse_unused(args) -> None:
    """Refuse an option that the command does not read (``--capacity``
    under ``sweep``): it was ignored, and the settings did not show it
    (found by an audit). ``all`` reads them all; ``report`` runs
    nothing."""
    if args.command in ('all', 'report'):
        return
    unused = [
        f"--{dest.replace('_', '-')} (read by {readers})"
        for readers, dests in _ONLY_FOR.items()
        if args.command not in readers.split(' and ') for dest in dests
        if getattr(args, dest) != args.defaults[dest]
    ]
    if unused:
        raise MmdtrError(
            f'{", ".join(unused)} '
            f'{"do" if len(unused) > 1 else "does"} not apply to '
            f'{args.command}.',
            hint=f'drop {unused[0].split()[0]}, or run the command that '
            'reads it (or all).')
