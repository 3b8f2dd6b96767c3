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
import traceback

from mmengine.config import Config
from mmengine.registry import RUNNERS

from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.adapters.cpu_process_group import (check_launcher_env, close_dist,
                                              dist_cfg_of)
from mmdtr.adapters.runner import MMDTRRunner, dump_config_as_written
from mmdtr.adapters.runner_config_checks import (amp_convertible,
                                                 check_amp_available)
from mmdtr.adapters.writable_config import refuse_unwritable
from mmdtr.errors import MmdtrError
from mmdtr.utils.cfg_options import (CfgOptionsAction, merge_cfg_options,
                                     read_config)
from mmdtr.utils.module_names import check_module_names, selecting_hooks
from mmdtr.utils.work_dirs import check_work_dir


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
    parser.add_argument(
        '--check-config',
        action='store_true',
        help='check the config and the arguments, then exit without '
        'training (tools/dist_train.sh does this once before it starts '
        'torchrun)')
    # When using PyTorch version >= 2.0.0, the `torch.distributed.launch`
    # will pass the `--local-rank` parameter to `tools/train.py` instead
    # of `--local_rank`.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def check_checkpoint(path: str) -> None:
    """Refuse ``--resume PATH`` when ``PATH`` is no file (URLs pass).

    Raises:
        MmdtrError: If ``path`` is a local path but not a file.
    """
    if '://' in path or osp.isfile(path):
        return
    raise MmdtrError(
        f'--resume {path!r}: no such checkpoint file.',
        hint='give the path of a .pth file, or --resume alone to resume '
        'from the latest checkpoint in the work dir.')


def build_cfg(args) -> Config:
    """Load the config and apply the command-line arguments to it.

    Args:
        args (argparse.Namespace): The parsed arguments.

    Returns:
        Config: The config, with mmdtr's memory keys translated into hooks.

    Raises:
        MmdtrError: On a missing config file, bad ``--cfg-options``, bad
            memory keys, ``--amp`` without a CUDA device, a work dir that is
            a file or under one, ``--resume`` of a missing file, or a value
            the runner cannot write to the work dir (an object).
    """
    cfg = read_config(args.config)
    if args.cfg_options is not None:
        merge_cfg_options(cfg, args.cfg_options)
    cfg.launcher = args.launcher

    # work_dir: command line > config > ./work_dirs/<config name>
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs',
                                osp.splitext(osp.basename(args.config))[0])
    check_work_dir(cfg.work_dir,
                   'work_dir' if args.work_dir is None else '--work-dir')

    if args.amp:
        if not isinstance(cfg.get('optim_wrapper'), dict):
            raise MmdtrError(
                '--amp needs an optim_wrapper dict in the config, got '
                f"{cfg.get('optim_wrapper')!r}.",
                hint='set optim_wrapper = dict(optimizer=...) or drop --amp.')
        optim_wrapper = cfg.optim_wrapper.get('type', 'OptimWrapper')
        if not amp_convertible(optim_wrapper):
            raise MmdtrError(
                f'--amp needs optim_wrapper.type OptimWrapper or '
                f'AmpOptimWrapper, got {optim_wrapper!r}.',
                hint='configure AMP in that wrapper itself (e.g. '
                "InplaceOptimWrapper's amp=dict(...)), or drop --amp.")
        check_amp_available(dict(type='AmpOptimWrapper'))
        cfg.optim_wrapper.type = 'AmpOptimWrapper'
        cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    check_amp_available(cfg.get('optim_wrapper'))

    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        check_checkpoint(args.resume)
        cfg.resume = True
        cfg.load_from = args.resume
    translated = translate_memory_keys(cfg)
    # after mmdtr's own checks, which say more of what they refuse; the
    # keys as written (MMEngine writes the config after making the work dir)
    refuse_unwritable(cfg)
    return translated


def build_runner(cfg: Config):
    """Build mmdtr's runner, or the config's own ``runner_type``.

    Another runner (MMEngine's ``Runner``) dumps the translated config to
    its work dir; it is dumped again as written, as mmdtr's runner dumps it,
    so that a restart from the dump honours ``--cfg-options`` on the memory
    keys (found by an adversarial search).
    """
    if 'runner_type' not in cfg:
        return MMDTRRunner.from_cfg(cfg)
    runner = RUNNERS.build(cfg)
    if not isinstance(runner, MMDTRRunner):
        dump_config_as_written(runner)
    return runner


def _from_the_engine(error: BaseException) -> bool:
    """Whether ``error`` was raised in the DTR engine (``mmdtr/core``)."""
    return any(
        osp.join('mmdtr', 'core', '') in frame.filename
        for frame in traceback.extract_tb(error.__traceback__))


def _checked_message(config: str, selecting: bool, unchecked) -> str:
    """What ``--check-config`` says it checked: the model is built for it
    (its own arguments checked too), unless under a launcher it could not
    be built here (``unchecked`` says why)."""
    head = f'mmdtr: {config} checked: the config, its mmdtr keys'
    if unchecked is not None:
        later = 'the module names are' if selecting else 'the model is'
        return (f'{head} and the arguments are accepted; {later} checked '
                f'when training starts: {unchecked}.')
    if not selecting:
        return (f'{head}, the arguments and the model are accepted; no '
                'module names to check.')
    return f'{head}, the arguments, the model and the module names are ' \
        'accepted.'


def main(argv=None):
    try:
        args = parse_args(argv)
        cfg = build_cfg(args)
        unchecked = None
        if args.check_config or args.launcher == 'none':
            # before the runner makes its work dir; under dist_train.sh
            # once, in its check, not in every rank (found by an
            # adversarial search)
            unchecked = check_module_names(
                cfg,
                strict=args.check_config and args.launcher == 'none',
                build_model=args.check_config)
        if args.check_config:
            print(
                _checked_message(args.config, bool(selecting_hooks(cfg)),
                                 unchecked))
            return
        # not in --check-config: tools/dist_train.sh runs it before torchrun
        check_launcher_env(args.launcher,
                           dist_cfg_of(cfg.get('env_cfg', None)))
        runner = build_runner(cfg)
    except MmdtrError as e:
        close_dist(wait=False)  # a runner may have made the group
        print(f'{type(e).__name__}: {e}', file=sys.stderr)
        sys.exit(1)
    try:
        runner.train()
    except MmdtrError as e:
        close_dist(wait=False)  # before the interpreter exits: see there
        if _from_the_engine(e):
            raise  # its traceback helps (a refusal, or a bug to report)
        # a setting checked against the model (a module name): one line,
        # as the config's own checks
        print(f'{type(e).__name__}: {e}', file=sys.stderr)
        sys.exit(1)
    except BaseException:
        close_dist(wait=False)  # before the interpreter exits: see there
        raise
    del runner  # its DDP wrapper goes before the group (see close_dist)
    close_dist()


if __name__ == '__main__':
    main()
