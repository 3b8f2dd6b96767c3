"""Train a model with mmdtr's memory-saving techniques.

Examples:
    python tools/train.py configs/resnet50_synthetic.py
    python tools/train.py CONFIG --cfg-options train_cfg.max_iters=100
    python tools/train.py CONFIG --resume            # latest in work_dir
    python tools/train.py CONFIG --resume work_dirs/x/iter_100.pth
    bash tools/dist_train.sh CONFIG 2                 # 2 processes
"""
import argparse
import os
import os.path as osp
import sys

from mmengine.config import Config, DictAction
from mmengine.registry import RUNNERS
from mmengine.utils import import_modules_from_strings

from mmdtr.adapters.config_translation import (MEMORY_KEY_TRANSLATORS,
                                               translate_memory_keys)
from mmdtr.adapters.distributed import close_dist
from mmdtr.adapters.runner import (MMDTRRunner, amp_convertible,
                                   check_amp_available)
from mmdtr.errors import MmdtrError


class CfgOptionsAction(DictAction):
    """:class:`~mmengine.config.DictAction` that rejects a missing ``=``."""

    def __call__(self, parser, namespace, values, option_string=None):
        for kv in values:
            if '=' not in kv:
                raise MmdtrError(
                    f'--cfg-options expects KEY=VALUE pairs, got {kv!r}.',
                    hint='e.g. --cfg-options train_cfg.max_iters=100 '
                    "optim_wrapper.optimizer.lr=0.01 'custom_imports."
                    "imports=[my_module]'")
        super().__call__(parser, namespace, values, option_string)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train a model with mmdtr')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument(
        '--resume',
        nargs='?',
        type=str,
        const='auto',
        help='If specify checkpoint path, resume from it, while if not '
        'specify, try to auto resume from the latest checkpoint '
        'in the work directory.')
    parser.add_argument(
        '--amp',
        action='store_true',
        help='enable automatic-mixed-precision training (needs CUDA)')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=CfgOptionsAction,
        help='override some settings in the used config, the key-value pair '
        'in xxx=yyy format will be merged into config file. If the value to '
        'be overwritten is a list, it should be like key="[a,b]" or key=a,b '
        'It also allows nested list/tuple values, e.g. key="[(a,b),(c,d)]" '
        'Note that the quotation marks are necessary and that no white space '
        'is allowed.')
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')
    # When using PyTorch version >= 2.0.0, the `torch.distributed.launch`
    # will pass the `--local-rank` parameter to `tools/train.py` instead
    # of `--local_rank`.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def merge_cfg_options(cfg: Config, options: dict) -> None:
    """Merge ``--cfg-options`` into ``cfg`` and import its custom_imports.

    MMEngine imports ``custom_imports`` only when it reads the config file,
    so imports given through ``--cfg-options`` are imported here.
    """
    for name in MEMORY_KEY_TRANSLATORS:
        # `dtr = None` in a file means off; `dtr.x=...` turns it on
        if name in cfg and cfg[name] is None and any(
                key.startswith(f'{name}.') for key in options):
            cfg[name] = {}
    try:
        cfg.merge_from_dict(options)
    except (TypeError, KeyError, IndexError, ValueError, AttributeError) as e:
        raise MmdtrError(
            f'--cfg-options {options!r} cannot be merged into '
            f'{cfg.filename}: {e}',
            hint='a dotted key must follow the nesting of the config.') from e
    if 'custom_imports' not in options and not any(
            key.startswith('custom_imports.') for key in options):
        return
    custom_imports = cfg.get('custom_imports')
    if not isinstance(custom_imports, dict) or 'imports' not in custom_imports:
        raise MmdtrError(
            f'custom_imports={custom_imports!r} is not accepted; expected '
            "dict(imports=['module', ...], allow_failed_imports=False).",
            hint="e.g. --cfg-options 'custom_imports.imports=[my_module]'.")
    try:
        import_modules_from_strings(**custom_imports)
    except ImportError as e:
        raise MmdtrError(
            f"custom_imports.imports={custom_imports['imports']!r} cannot be "
            f'imported: {e}',
            hint='check the module names and PYTHONPATH.') from e


def build_cfg(args) -> Config:
    """Load the config and apply the command-line arguments to it.

    Args:
        args (argparse.Namespace): The parsed arguments.

    Returns:
        Config: The config, with mmdtr's memory keys translated into hooks.

    Raises:
        MmdtrError: On bad ``--cfg-options``, bad memory keys, or ``--amp``
            without a CUDA device.
    """
    if not osp.isfile(args.config):
        raise MmdtrError(
            f'config file {args.config!r} does not exist.',
            hint='give the path of a config file, e.g. configs/demo_dtr.py.')
    cfg = Config.fromfile(args.config)
    if args.cfg_options is not None:
        merge_cfg_options(cfg, args.cfg_options)
    cfg.launcher = args.launcher

    # work_dir: command line > config > ./work_dirs/<config name>
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs',
                                osp.splitext(osp.basename(args.config))[0])

    if args.amp:
        if not isinstance(cfg.get('optim_wrapper'), dict):
            raise MmdtrError(
                '--amp needs an optim_wrapper dict in the config, got '
                f"{cfg.get('optim_wrapper')!r}.",
                hint='set optim_wrapper = dict(optimizer=...) or drop --amp.')
        check_amp_available(dict(type='AmpOptimWrapper'))
        optim_wrapper = cfg.optim_wrapper.get('type', 'OptimWrapper')
        if not amp_convertible(optim_wrapper):
            raise MmdtrError(
                f'--amp needs optim_wrapper.type OptimWrapper or '
                f'AmpOptimWrapper, got {optim_wrapper!r}.',
                hint='configure AMP in that wrapper itself, or drop --amp.')
        cfg.optim_wrapper.type = 'AmpOptimWrapper'
        cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    check_amp_available(cfg.get('optim_wrapper'))

    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    return translate_memory_keys(cfg)


def build_runner(cfg: Config):
    """Build mmdtr's runner, or the config's own ``runner_type``."""
    if 'runner_type' in cfg:
        return RUNNERS.build(cfg)
    return MMDTRRunner.from_cfg(cfg)


def main(argv=None):
    try:
        args = parse_args(argv)
        cfg = build_cfg(args)
        runner = build_runner(cfg)
    except MmdtrError as e:
        close_dist(wait=False)  # a runner may have made the group
        print(f'{type(e).__name__}: {e}', file=sys.stderr)
        sys.exit(1)
    try:
        runner.train()
    except BaseException:
        close_dist(wait=False)  # before the interpreter exits: see there
        raise
    del runner  # its DDP wrapper goes before the group (see close_dist)
    close_dist()


if __name__ == '__main__':
    main()
