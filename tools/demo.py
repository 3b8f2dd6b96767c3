"""Train a config without and with its memory features; print what it saved.

    python tools/demo.py [CONFIG] [--cfg-options K=V ...]

The default CONFIG is configs/demo_dtr.py (ResNet-50 with DTR on synthetic
data). Both runs train the same iterations from the same seed. Peak memory is
measured independently of mmdtr, by torch.profiler's allocation events over
one training iteration of each run; DTR's own meter, evictions and
recomputations come from the log. Time per iteration is the median over the
iterations after the profiled one.
"""
import argparse
import os.path as osp
import statistics
import sys
import tempfile

from mmengine.hooks import Hook
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))
from mmdtr.adapters.config_translation import (  # noqa: E402
    MEMORY_KEY_TRANSLATORS, translate_memory_keys)
from mmdtr.adapters.runner import MMDTRRunner  # noqa: E402
from mmdtr.core.sizes import format_size  # noqa: E402
from mmdtr.errors import MmdtrError  # noqa: E402
from mmdtr.utils import cfg_options  # noqa: E402
from mmdtr.utils.module_names import CHECKED_ATTR  # noqa: E402
from mmdtr.utils.module_names import check_module_names  # noqa: E402
from mmdtr.utils.profiler_memory import memory_deltas  # noqa: E402

PROFILED_ITER = 1  # the first iteration warms up; time the ones after


class _PeakProbe(Hook):
    """Profiles one training iteration's allocations; times the rest."""

    def __init__(self):
        self.prof, self.peak, self.times = None, None, []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter == PROFILED_ITER:
            self.prof = profile(
                activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()

    def after_train_iter(self,
                         runner,
                         batch_idx,
                         data_batch=None,
                         outputs=None):
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            live = peak = 0
            for delta in memory_deltas(self.prof):
                live += delta
                peak = max(peak, live)
            self.prof, self.peak = None, peak
        elif runner.iter > PROFILED_ITER:
            self.times.append(
                runner.message_hub.get_scalar('train/time').current())


def _without_features(cfg):
    cfg = cfg.copy()
    for key in MEMORY_KEY_TRANSLATORS:
        cfg.pop(key, None)
    return cfg


def train(cfg, with_features, work_dir):
    """Train ``cfg`` once, with or without its memory keys, and measure it.

    Args:
        cfg (Config): The config from :func:`build_cfg`.
        with_features (bool): Keep the memory keys; False drops them all
            (the baseline).
        work_dir (str): The run's work directory.

    Returns:
        tuple: ``(peak, time, dtr)``: the profiled iteration's peak in
        bytes (torch.profiler), the median time per iteration after it, and
        the latest values of the ``train/dtr_*`` scalars (``peak_memory_mb``,
        ``evictions``, ``recomputations``) that the log has, by short name.
    """
    cfg = cfg.copy() if with_features else _without_features(cfg)
    cfg.work_dir = work_dir
    cfg = translate_memory_keys(cfg)
    if with_features:  # build_cfg checked its module names: not again
        object.__setattr__(cfg, CHECKED_ATTR, True)
    probe = _PeakProbe()
    runner = MMDTRRunner.from_cfg(cfg)
    runner.register_hook(probe, priority='LOWEST')
    runner.train()
    hub = runner.message_hub
    dtr = {
        key: hub.get_scalar(f'train/dtr_{key}').current()
        for key in ('peak_memory_mb', 'evictions', 'recomputations')
        if f'train/dtr_{key}' in hub.log_scalars
    }
    return probe.peak, statistics.median(probe.times), dtr


def parse_args(argv=None):
    """Parse the demo's arguments: an optional config, ``--cfg-options``.

    Args:
        argv (list, optional): The arguments; by default ``sys.argv``'s.

    Returns:
        argparse.Namespace: ``config`` (default ``configs/demo_dtr.py``)
        and ``cfg_options``.
    """
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument(
        'config',
        nargs='?',
        default=osp.join(
            osp.dirname(osp.dirname(osp.abspath(__file__))), 'configs',
            'demo_dtr.py'))
    parser.add_argument(
        '--cfg-options', nargs='+', action=cfg_options.CfgOptionsAction)
    return parser.parse_args(argv)


def build_cfg(args):
    """Read and check the config before anything trains.

    Both runs' configs are translated here, and the module names the
    hooks select checked on the model, built as the runner builds it, so
    a bad memory key (e.g. ``dtr.eviction_threshold=3XB``,
    ``activation_checkpointing=nothing``) or model argument is refused
    before the baseline trains.

    Args:
        args (argparse.Namespace): The parsed arguments.

    Returns:
        tuple: ``(cfg, features)``: the config (at least
        ``PROFILED_ITER + 2`` iterations) and the memory keys it sets.

    Raises:
        MmdtrError: On a missing config file, bad ``--cfg-options``, a
            config without iterations to train or without any memory key,
            or a bad memory key.
    """
    cfg = cfg_options.read_config(args.config)
    if args.cfg_options:
        cfg_options.merge_cfg_options(cfg, args.cfg_options)
    train_cfg, max_iters, loop = cfg.get('train_cfg'), None, None
    if isinstance(train_cfg, dict):
        max_iters = train_cfg.get('max_iters')
        loop = str(  # MMEngine's default loop follows by_epoch
            train_cfg.get(
                'type', 'EpochBasedTrainLoop'
                if train_cfg.get('by_epoch') else 'IterBasedTrainLoop'))
    if isinstance(max_iters, bool) or not isinstance(max_iters, int) \
            or max_iters < 1 or loop.rsplit('.', 1)[-1] != \
            'IterBasedTrainLoop':
        raise MmdtrError(
            f'train_cfg={train_cfg!r} of {args.config} is not an '
            'IterBasedTrainLoop with a positive int max_iters; the demo '
            'trains a number of iterations.',
            hint='use an iteration-based config, e.g. '
            "train_cfg = dict(type='IterBasedTrainLoop', max_iters=4).")
    if max_iters < PROFILED_ITER + 2:
        cfg.train_cfg.max_iters = PROFILED_ITER + 2
    features = [k for k in MEMORY_KEY_TRANSLATORS if cfg.get(k) is not None]
    if not features:
        raise MmdtrError(
            f'{args.config} sets none of the memory keys '
            f'{list(MEMORY_KEY_TRANSLATORS)}: there is nothing to compare '
            'the baseline with.',
            hint='turn one on, e.g. --cfg-options '
            'dtr.eviction_threshold=200MB.')
    # the model built too: an argument it refuses (model.typo_arg=1) was a
    # traceback of the baseline's build (found by a walk through the docs)
    check_module_names(
        translate_memory_keys(cfg), strict=True, build_model=True)
    translate_memory_keys(_without_features(cfg))
    return cfg, features


def demo(args) -> None:
    """Train without and with the memory features; print the comparison.

    Args:
        args (argparse.Namespace): The parsed arguments.

    Raises:
        MmdtrError: On a bad config (see :func:`build_cfg`).
    """
    cfg, features = build_cfg(args)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [('without', *train(cfg, False, osp.join(tmp, 'base')))]
        rows.append(('with ' + ', '.join(features),
                     *train(cfg, True, osp.join(tmp, 'features'))))
    (_, base_peak, base_time, _), (name, peak, time, dtr) = rows
    print(f'\nmmdtr demo: {osp.basename(args.config)}, '
          f'{cfg.train_cfg.max_iters} iterations, features: '
          f'{", ".join(features)}')
    print(f'{"run":<24}{"peak memory":>14}{"s/iter":>10}')
    for run, run_peak, run_time, _ in rows:
        print(f'{run:<24}{format_size(run_peak):>14}{run_time:>10.3f}')
    saved = 1 - peak / base_peak
    print(f'saved {format_size(base_peak - peak)} of peak memory '
          f'({saved:.0%}) for {time / base_time:.2f}x the time per iteration '
          '(peaks by torch.profiler over one iteration)')
    if dtr:
        print(f'DTR: meter peak {dtr["peak_memory_mb"]:.1f} MiB, '
              f'{int(dtr["evictions"])} evictions, '
              f'{int(dtr["recomputations"])} recomputations in the last '
              'iteration')


def main(argv=None) -> None:
    """Run the demo; on an :class:`MmdtrError`, print it and exit with 1.

    Args:
        argv (list, optional): The arguments; by default ``sys.argv``'s.
    """
    try:
        demo(parse_args(argv))
    except MmdtrError as error:
        print(f'{type(error).__name__}: {error}', file=sys.stderr)
        sys.exit(1)


if __name__ == '__main__':
    main()
