"""Benchmark what DTR buys: threshold sweep, alternatives, largest batch.

Every measured run runs in a process of its own. Results go to
``--work-dir`` (default ``work_dirs/benchmark/<config name>``):
``results.json``, ``benchmark.md`` and PNG plots. See docs/benchmarks.md.

Examples:
    python tools/benchmark.py configs/resnet50_synthetic.py sweep \
        --batch-size 8 --image-size 112 --fractions 0.9 0.7 0.5 0.3 0.25
    python tools/benchmark.py CONFIG sweep --thresholds 200MB 100MB
    python tools/benchmark.py CONFIG compare --match checkpoint_sqrt
    python tools/benchmark.py CONFIG largest-batch --capacity 1GB
    python tools/benchmark.py CONFIG all --capacity 1GB
    python tools/benchmark.py CONFIG all --quick     # a smoke test
    python tools/benchmark.py CONFIG report          # redraw from JSON
"""
import os.path as osp
import signal
import sys
import time
from typing import Optional

from mmengine.config import Config

from mmdtr.benchmarking import BenchmarkSuite, Launcher, check_workload
from mmdtr.benchmarking.arguments import parse_match
from mmdtr.benchmarking.command_line import (DEFAULT_FRACTIONS, QUICK,
                                             check_args, max_batch, parse_args,
                                             quick_default)
from mmdtr.benchmarking.largest_batch import probe_steps
from mmdtr.benchmarking.launch import default_launcher
from mmdtr.benchmarking.report import write_report
from mmdtr.benchmarking.results import read_results
from mmdtr.benchmarking.results_updates import (drop_sections, failed_runs,
                                                failures_message, machine_info,
                                                none_ran, update_results)
from mmdtr.benchmarking.workloads import load_config
from mmdtr.core.sizes import format_size, parse_size
from mmdtr.errors import MmdtrError
from mmdtr.utils.work_dirs import check_work_dir


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
    batch_size = quick_default(args.batch_size, 'batch_size', args,
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
        recording=args.recording,
        warmup=quick_default(args.warmup, 'warmup', args, 1),
        steps=quick_default(args.steps, 'steps', args, 3),
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
    largest = max_batch(args)
    headroom = parse_size(args.headroom, '--headroom')
    start_batch = args.start_batch or 1
    # the probes' own batches and steps, not the config's (found by a review)
    for key in ('batch_size', 'warmup', 'steps'):
        settings.pop(key, None)
    cuda = suite.cuda
    settings.update(
        capacity=capacity,
        max_batch=largest,
        start_batch=start_batch,
        policy=args.policy,
        headroom=headroom,
        probe_steps=dict(
            dtr=probe_steps(cuda, 'dtr'),
            baseline=probe_steps(cuda, 'baseline')))
    result = suite.largest_batch(capacity, largest, args.policy, headroom,
                                 start_batch)
    return 'largest_batch', dict(settings=settings, result=result)


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
    try:
        return _run(args, work_dir)
    except OSError as error:  # os.access passes for root, and /sys refuses
        # writes anyway; a file in the way of logs/ (found by an
        # adversarial search: raw tracebacks)
        if not _inside(error.filename, work_dir) or isinstance(
                error, FileNotFoundError):
            raise  # not the work dir's, or a file read there (a config's
            # missing base; a review)
        raise MmdtrError(
            f'cannot write {error.filename!r} in the work dir: '
            f'{error.strerror}.',
            hint='give a --work-dir you can write to, with nothing in the '
            'way of its logs/, results.json, benchmark.md and plots.'
        ) from error


def _inside(path, work_dir: str) -> bool:
    """Whether ``path`` is ``work_dir`` or under it."""
    if path is None:
        return False
    path, work_dir = osp.abspath(str(path)), osp.abspath(work_dir)
    return osp.commonpath([path, work_dir]) == work_dir


def _run(args, work_dir: str) -> int:
    """:func:`main` once the work dir is checked."""
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
    if args.threads:  # each run's, not this process's (found by a review)
        meta['torch_threads'] = args.threads
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
        # its own: another invocation's sections in the same work dir keep
        # theirs (found by an adversarial search: they took this one's)
        data['machine'] = meta
        results = update_results(json_path, meta, section, data)
        write_report(results, work_dir)
        failed, runs = failed_runs(section, data)
        failures, total = failures + failed, total + runs
        if none_ran(section, data):
            not_run = commands[i + 1:]
            # an earlier invocation's sections of those would stand under
            # this one's machine line (found by an audit)
            results = drop_sections(json_path,
                                    [c.replace('-', '_') for c in not_run])
            break
    for path in [json_path] + write_report(results, work_dir):
        print(f'wrote {path}')
    if failures:
        raise MmdtrError(
            failures_message(failures, total, not_run, work_dir),
            hint='fix what their logs show (e.g. a smaller --batch-size for '
            "runs out of memory, a larger --timeout for runs that timed "
            'out) and run the command again.')
    return 0


def _exit_on_sigterm(signum, frame):
    """SIGTERM (``timeout``, a cancelled job) as an exit, so that the
    run in progress is stopped on the way out as for Ctrl-C: killed at
    once, it went on alone, with the fork server (found by an adversarial
    search)."""
    sys.exit(128 + signum)


if __name__ == '__main__':
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        sys.exit(main())
    except MmdtrError as error:
        sys.exit(f'{type(error).__name__}: {error}')
