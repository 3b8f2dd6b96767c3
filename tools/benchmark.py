"""Benchmark what DTR buys: threshold sweep, alternatives, largest batch.

Every measured run runs in a process of its own. Results go to
``--work-dir`` (default ``work_dirs/benchmark/<config name>``):
``results.json``, ``benchmark.md`` and PNG plots. See docs/benchmarks.md.

Examples:
    python tools/benchmark.py configs/resnet50_synthetic.py sweep \
        --batch-size 8 --image-size 112 --fractions 0.9 0.7 0.5 0.3 0.2
    python tools/benchmark.py CONFIG sweep --thresholds 200MB 100MB
    python tools/benchmark.py CONFIG compare --match checkpoint_sqrt
    python tools/benchmark.py CONFIG largest-batch --capacity 1GB
    python tools/benchmark.py CONFIG all --capacity 1GB
    python tools/benchmark.py CONFIG all --quick     # a smoke test
    python tools/benchmark.py CONFIG report          # redraw from JSON
"""
import argparse
import os.path as osp
import sys
import time
from typing import Optional

from mmengine.config import Config

from mmdtr.benchmarking import (ALTERNATIVES, LAUNCHERS, OPTIMIZERS,
                                BenchmarkSuite, Launcher, check_workload,
                                load_config)
from mmdtr.benchmarking.arguments import (check_device, check_numbers,
                                          check_threshold, parse_match)
from mmdtr.benchmarking.launch import default_launcher
from mmdtr.benchmarking.report import (drop_sections, failed_runs,
                                       failures_message, machine_info,
                                       update_results, write_report)
from mmdtr.benchmarking.results import read_results
from mmdtr.core.policies import POLICIES
from mmdtr.core.sizes import format_size, parse_size
from mmdtr.errors import MmdtrError
from mmdtr.utils.cfg_options import CfgOptionsAction
from mmdtr.utils.work_dirs import check_work_dir

COMMANDS = ('sweep', 'compare', 'largest-batch', 'all', 'report')
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


def parse_args(argv=None):
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


def _default(value, quick_key, args, normal):
    if value is not None:
        return value
    return QUICK[quick_key] if args.quick else normal


def _max_batch(args) -> int:
    """The largest batch largest-batch tries."""
    return _default(args.max_batch, 'max_batch', args, 1024)


def build_suite(args, cfg: Config, work_dir: str) -> BenchmarkSuite:
    """The suite of runs the arguments describe."""
    dataset = cfg.train_dataloader.dataset
    image_size = args.image_size
    seq_len = args.seq_len
    if args.quick:
        if image_size is None and 'image_size' in dataset:
            image_size = QUICK['image_size']
        if seq_len is None and 'seq_len' in dataset:
            seq_len = QUICK['seq_len']
    batch_size = _default(args.batch_size, 'batch_size', args,
                          cfg.train_dataloader.get('batch_size'))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
            or batch_size < 1:
        raise MmdtrError(
            f'train_dataloader.batch_size={batch_size!r} of {args.config} '
            'is not a positive int.',
            hint='give the batch size with --batch-size.')
    settings = dict(
        config=osp.abspath(args.config),
        batch_size=batch_size,
        cfg_options=args.cfg_options or {},
        image_size=image_size,
        seq_len=seq_len,
        device=args.device,
        evictee_minimum_size=parse_size(args.evictee_minimum_size,
                                        '--evictee-minimum-size'),
        sqrt_sampling=args.sqrt_sampling,
        warmup=_default(args.warmup, 'warmup', args, 1),
        steps=_default(args.steps, 'steps', args, 3),
        optimizer=args.optimizer,
        blocks=args.blocks,
        threads=args.threads,
        seed=args.seed)
    launcher = Launcher(
        args.launcher or default_launcher(args.device),
        osp.join(work_dir, 'logs'), args.timeout)
    return BenchmarkSuite(launcher, not args.no_progress, args.repeats,
                          **settings)


def quick_capacity(args, suite: BenchmarkSuite) -> int:
    """``--quick``'s capacity: a quarter above the baseline's peak.

    Its baseline run is the sweep's and compare's (the suite runs it once).

    Raises:
        MmdtrError: If the baseline run fails, or ``--headroom`` leaves no
            room in the capacity.
    """
    bar = suite.bar(1, 'baseline')
    record = suite.run('baseline', suite.spec('baseline'), bar)
    bar.close()
    if not record['peak_engine']:
        raise MmdtrError(
            f"the baseline run that sets --quick's capacity ended "
            f"{record['status']!r} ({record.get('error')}); see "
            f"{record.get('log')}.",
            hint='fix what its log shows, or give --capacity.')
    capacity = int(record['peak_engine'] * 1.25)
    if parse_size(args.headroom, '--headroom') >= capacity:
        raise MmdtrError(
            f'--headroom {args.headroom} leaves no room in the capacity '
            f'{format_size(capacity)} that --quick took (a quarter above '
            "the baseline's peak).",
            hint='give a smaller --headroom, or a --capacity.')
    return capacity


def run_command(command: str,
                args,
                suite: BenchmarkSuite,
                capacity: Optional[int] = None) -> tuple:
    """Run one benchmark; return ``(section name, section data)``.

    ``capacity`` (bytes) is largest-batch's; by default ``--capacity``.
    """
    settings = dict(suite.settings, command=command)
    if command == 'sweep':
        fractions = args.fractions
        if fractions is None:
            fractions = (() if args.thresholds else QUICK['fractions']
                         if args.quick else DEFAULT_FRACTIONS)
        thresholds = [parse_size(t, '--thresholds') for t in args.thresholds]
        settings.update(
            policy=args.policy,
            fractions=list(fractions),
            thresholds=thresholds,
            repeats=args.repeats)
        runs = suite.sweep(fractions, thresholds, args.policy)
        return 'sweep', dict(settings=settings, runs=runs)
    if command == 'compare':
        settings.update(match=args.match, policies=args.policies)
        runs = suite.compare(parse_match(args.match), args.policies)
        return 'compare', dict(settings=settings, runs=runs)
    if capacity is None:
        capacity = parse_size(args.capacity, '--capacity')
    max_batch = _max_batch(args)
    headroom = parse_size(args.headroom, '--headroom')
    start_batch = args.start_batch or 1
    settings.update(
        capacity=capacity,
        max_batch=max_batch,
        start_batch=start_batch,
        policy=args.policy,
        headroom=headroom)
    result = suite.largest_batch(capacity, max_batch, args.policy, headroom,
                                 start_batch)
    return 'largest_batch', dict(settings=settings, result=result)


def check_args(args) -> None:
    """Reject bad arguments before anything runs; resolve ``--device``."""
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
            raise MmdtrError(f'{args.command} needs --capacity, e.g. 1GB.')
        if capacity == 0:
            raise MmdtrError(
                f'--capacity {args.capacity} must be above 0.',
                hint='e.g. --capacity 1GB.')
        if capacity is not None and headroom >= capacity:
            raise MmdtrError(f'--headroom {args.headroom} leaves no room in '
                             f'--capacity {args.capacity}.')
        max_batch = _max_batch(args)
        quick_max = args.max_batch is None and args.quick
        if args.start_batch is not None and args.start_batch > max_batch:
            raise MmdtrError(
                f'--start-batch {args.start_batch} is above the largest '
                f'batch tried, {max_batch} (--max-batch'
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
    'sweep': ('fractions', 'thresholds'),
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


def main(argv=None) -> int:
    """Run the command; raise :class:`MmdtrError` on bad input or failures.

    Returns:
        int: 0.
    """
    args = parse_args(argv)
    check_args(args)
    name = osp.splitext(osp.basename(args.config))[0]
    given = args.work_dir is not None  # '' is refused, not replaced
    work_dir = args.work_dir if given else osp.join('work_dirs', 'benchmark',
                                                    name)
    check_work_dir(work_dir, '--work-dir' if given else 'the default work dir')
    json_path = osp.join(work_dir, 'results.json')
    # a results.json that is not the benchmark's is refused before any run
    results = read_results(json_path)
    if args.command == 'report':
        if not osp.exists(json_path):
            raise MmdtrError(
                f'no {json_path} to report on.',
                hint='run a benchmark first, or give its '
                '--work-dir.')
        for path in write_report(results, work_dir):  # not the JSON
            print(f'wrote {path}')
        return 0
    cfg = load_config(args.config, args.cfg_options, args.image_size,
                      args.seq_len)
    suite = build_suite(args, cfg, work_dir)
    # the alternatives checkpoint blocks: the glob is resolved now (a glob
    # given to another command too, so that a typo is never ignored)
    check_workload(
        cfg, args.blocks if args.command in ('compare', 'all')
        or args.blocks is not None else False)
    commands = (('sweep', 'compare',
                 'largest-batch') if args.command == 'all' else
                (args.command, ))
    meta = machine_info(args.device)
    if not (args.quick or args.no_prime):
        suite.prime()
    capacity = None
    if 'largest-batch' in commands and args.capacity is None:
        capacity = quick_capacity(args, suite)
    failures, total, not_run = [], 0, ()
    for i, command in enumerate(commands):
        start = time.monotonic()
        section, data = run_command(command, args, suite, capacity)
        data['settings']['wall_s'] = round(time.monotonic() - start, 1)
        results = update_results(json_path, meta, section, data)
        write_report(results, work_dir)
        failed, runs = failed_runs(section, data)
        failures, total = failures + failed, total + runs
        if failed and len(failed) == runs:
            not_run = commands[i + 1:]
            # an earlier invocation's sections of those would stand under
            # this one's machine line (found by an audit)
            results = drop_sections(json_path,
                                    [c.replace('-', '_') for c in not_run])
            break
    for path in [json_path] + write_report(results, work_dir):
        print(f'wrote {path}')
    if failures:
        raise MmdtrError(failures_message(failures, total, not_run, work_dir))
    return 0


if __name__ == '__main__':
    try:
        sys.exit(main())
    except MmdtrError as error:
        sys.exit(f'{type(error).__name__}: {error}')
