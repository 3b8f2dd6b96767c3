"""mmdtr's Runner: MMEngine's Runner that honours mmdtr's config keys.

It adds three things to :class:`mmengine.runner.Runner`:

- :meth:`MMDTRRunner.from_cfg` translates mmdtr's memory keys
  (:func:`~mmdtr.adapters.config_translation.translate_memory_keys`), so a
  downstream repo's own ``tools/train.py`` honours the same keys as mmdtr's;
- distributed training on a CPU-only machine: the process group is
  initialised with gloo and the model is wrapped by
  :class:`~mmdtr.adapters.distributed.MMDTRDistributedDataParallel`
  (with CUDA, MMEngine's nccl and ``MMDistributedDataParallel`` are kept);
- checkpoints load with ``torch.load(weights_only=True)`` (see
  :mod:`mmdtr.adapters.checkpoint_loading`).

MMEngine builds a runner either with ``Runner.from_cfg(cfg)`` or, when the
config has ``runner_type``, with ``RUNNERS.build(cfg)``, which calls
``runner_cls.from_cfg(cfg)``. Both routes go through
:meth:`MMDTRRunner.from_cfg`; translation is idempotent, so a config that
``tools/train.py`` already translated is not translated again.
"""
import difflib
import inspect
import os.path as osp
from typing import Dict, Optional, Union

from mmengine.config import Config, ConfigDict
from mmengine.device import (get_device, is_cuda_available, is_mlu_available,
                             is_npu_available)
from mmengine.dist import is_distributed, is_main_process
from mmengine.model import is_model_wrapper
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS
from mmengine.runner import Runner
from torch import distributed as torch_dist
from torch import nn

from mmdtr.errors import MmdtrError
from mmdtr.registry import MODEL_WRAPPERS, OPTIM_WRAPPERS, RUNNERS
from .checkpoint_loading import register_checkpoint_safe_globals
from .config_translation import (SOURCE_ATTR, check_scoped_type, config_check,
                                 mmdtr_only, refuse_unless_dict,
                                 translate_memory_keys)
from .distributed import check_cpu_dist_cfg, dist_cfg_of, init_cpu_dist
from .inplace_optim_settings import (BUILDER_KEYS, check_accumulative_counts,
                                     check_keys, check_wrapper_config,
                                     clip_grad_settings)


def _is_wrapper(wrapper_type, cls, subclasses: bool = False) -> bool:
    """Whether a config's ``type`` is ``cls``: its name, scoped or not, or
    the class itself (new-style configs), or with ``subclasses`` one of
    its subclasses."""
    if isinstance(wrapper_type, str):
        return wrapper_type.split('.')[-1] == cls.__name__
    if subclasses:
        return isinstance(wrapper_type, type) and issubclass(wrapper_type, cls)
    return wrapper_type is cls


def _is_amp(wrapper_type) -> bool:
    from mmengine.optim import AmpOptimWrapper
    return _is_wrapper(wrapper_type, AmpOptimWrapper, subclasses=True)


def amp_convertible(wrapper_type) -> bool:
    """Whether ``--amp`` may make ``wrapper_type`` an ``AmpOptimWrapper``:
    MMEngine's ``OptimWrapper`` or ``AmpOptimWrapper``, as a name (scoped or
    not) or as the class (new-style configs)."""
    from mmengine.optim import AmpOptimWrapper, OptimWrapper
    return _is_wrapper(wrapper_type, OptimWrapper) or _is_wrapper(
        wrapper_type, AmpOptimWrapper)


def check_amp_available(optim_wrapper: Optional[dict]) -> None:
    """Fail early if ``optim_wrapper`` asks for AMP on a CPU-only machine.

    MMEngine's ``AmpOptimWrapper`` needs CUDA, NPU or MLU, and otherwise
    fails with an assertion deep inside the runner.

    Args:
        optim_wrapper (dict, optional): The ``optim_wrapper`` config; a dict
            of such configs (one per optimizer) is accepted too.

    Raises:
        MmdtrError: If an ``AmpOptimWrapper`` is asked for and no supported
            accelerator is available.
    """
    if is_cuda_available() or is_npu_available() or is_mlu_available():
        return
    for wrapper in _wrapper_cfgs(optim_wrapper):
        if _is_amp(wrapper.get('type')):
            raise MmdtrError(
                f"optim_wrapper.type={wrapper.get('type')!r} (AMP, e.g. from "
                '--amp) needs a CUDA, NPU or MLU device, but none is '
                "available; MMEngine's AmpOptimWrapper cannot run on CPU.",
                hint="drop --amp, or use optim_wrapper.type='OptimWrapper'.")


def _wrapper_cfgs(optim_wrapper) -> list:
    """The optimizer-wrapper configs of ``optim_wrapper`` (one, or a dict of
    them, one per optimizer)."""
    if not isinstance(optim_wrapper, dict):
        return []
    if 'type' not in optim_wrapper and 'optimizer' not in optim_wrapper:
        return [w for w in optim_wrapper.values() if isinstance(w, dict)]
    return [optim_wrapper]


def _is_inplace(wrapper_type) -> bool:
    """Whether the type is ``InplaceOptimWrapper`` itself (a subclass may
    take arguments of its own: its constructor checks them)."""
    from .inplace_optim_wrapper import InplaceOptimWrapper
    if isinstance(wrapper_type, str) and '.' in wrapper_type and \
            not wrapper_type.startswith('mmdtr.'):
        return False  # another scope's (_check_wrapper_keys names it)
    return _is_wrapper(wrapper_type, InplaceOptimWrapper)


@config_check
def check_cpu_distributed(cfg, custom_hooks: list) -> None:
    """With a launcher and no accelerator, check ``env_cfg.dist_cfg`` and
    refuse ``sync_bn`` when the config is read: ``tools/dist_train.sh``
    checks once, before the ranks start (found by an adversarial search:
    each failed once per rank, then in torchrun's traceback).

    Args:
        cfg (Config): The config.
        custom_hooks (list): Its hooks (unused).

    Raises:
        MmdtrError: On a ``dist_cfg`` value CPU training cannot use, or
            ``sync_bn``: PyTorch's SyncBatchNorm runs on GPU modules only.
    """
    if cfg.get('launcher', 'none') in (None, 'none') or get_device() != 'cpu':
        return
    check_cpu_dist_cfg(**dist_cfg_of(cfg.get('env_cfg', None)))
    sync_bn = cfg.get('sync_bn', None)
    if sync_bn is not None:
        raise MmdtrError(
            f'sync_bn={sync_bn!r} cannot run on CPU: SyncBatchNorm works '
            'with GPU modules only.',
            hint='leave sync_bn out on CPU (each rank then keeps batch '
            'statistics of its own).')


@config_check
def check_optim_wrappers(cfg, custom_hooks: list) -> None:
    """Check the optimizer wrappers' settings before the runner is built.

    ``accumulative_counts`` must be a positive int (MMEngine's
    ``OptimWrapper`` accepts ``2.5`` and ``True`` and asserts on 0 deep
    inside the runner); an ``InplaceOptimWrapper`` is checked whole, as its
    constructor would check it when ``runner.train()`` builds it.

    Raises:
        MmdtrError: On a setting that is not accepted.
    """
    distributed = cfg.get('launcher', 'none') not in (None, 'none')
    default_scope = cfg.get('default_scope', None)
    optim_wrapper = cfg.get('optim_wrapper', None)
    refuse_unless_dict(
        'optim_wrapper', optim_wrapper,
        'a dict (or a dict of them, one per optimizer)',
        "e.g. optim_wrapper=dict(type='OptimWrapper', "
        "optimizer=dict(type='SGD', lr=0.01)); on the command line "
        'set its keys: optim_wrapper.type=InplaceOptimWrapper.')
    # a custom constructor may read keys of its own, in its own way
    default = _default_constructor(optim_wrapper or {})
    for wrapper in _wrapper_cfgs(optim_wrapper):
        check_scoped_type('optim_wrapper', wrapper, OPTIM_WRAPPERS,
                          default_scope)
        built_by_default = default and _default_constructor(wrapper)
        if built_by_default:
            _check_optimizer_key(wrapper)
        if _is_inplace(wrapper.get('type')):
            check_wrapper_config(wrapper, distributed)
            continue
        if built_by_default and ('type' in wrapper or 'optimizer' in wrapper):
            _check_wrapper_keys(wrapper, default_scope)
        if 'accumulative_counts' in wrapper:
            check_accumulative_counts(wrapper['accumulative_counts'], False)
        if amp_convertible(wrapper.get('type', 'OptimWrapper')):
            # MMEngine's own: an assertion or a ValueError in train()
            clip_grad_settings(wrapper.get('clip_grad', None), False)


def _check_optimizer_key(wrapper: dict) -> None:
    """The default constructor builds ``optimizer`` from a dict (anything
    else failed in ``runner.train()`` with an AttributeError)."""
    optimizer = wrapper.get('optimizer', None)
    if 'optimizer' in wrapper and not isinstance(optimizer, dict):
        raise MmdtrError(
            f'optim_wrapper.optimizer={optimizer!r} is not accepted: '
            "MMEngine's default constructor builds it from a dict with a "
            'type.',
            hint="e.g. optimizer=dict(type='SGD', lr=0.01, momentum=0.9).")


def _check_wrapper_keys(wrapper: dict, default_scope) -> None:
    """Refuse a wrapper type of mmdtr's or MMEngine's scope that is not
    registered while close to one that is (``InplaceOptimWrapperr``), and
    keys the wrapper does not take (``accumulative_count``): MMEngine's
    default constructor would fail on either in ``runner.train()``, in a
    traceback. Other scopes' types are left to MMEngine (their registries
    may not be imported yet)."""
    wrapper_type = wrapper.get('type', 'OptimWrapper')
    cls = wrapper_type if isinstance(wrapper_type, type) else \
        OPTIM_WRAPPERS.get(wrapper_type)
    if cls is None:
        scope, _, name = str(wrapper_type).rpartition('.')
        scope = scope or wrapper.get('_scope_', None) or default_scope
        if scope not in (None, 'mmdtr', 'mmengine'):
            return
        known = sorted(
            {*OPTIM_WRAPPERS.module_dict, *OPTIM_WRAPPERS.parent.module_dict})
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if close:
            ours = mmdtr_only(OPTIM_WRAPPERS, close[0])
            raise MmdtrError(
                f'optim_wrapper type={wrapper_type!r} is not registered.',
                hint=f'closest match: '
                f"{'mmdtr.' + close[0] if ours else close[0]!r}; "
                f'registered: {known}.')
        return  # not close to any: MMEngine names it
    check_keys(
        wrapper,
        sorted({*BUILDER_KEYS, *_init_parameters(cls)} - {'self'}),
        'optim_wrapper',
        f'an argument of {cls.__name__} or a key of its builder',
        values=wrapper)


def _default_constructor(wrapper: dict) -> bool:
    constructor = wrapper.get('constructor', None)
    return constructor is None or str(constructor).split(
        '.')[-1] == 'DefaultOptimWrapperConstructor'


def _init_parameters(cls) -> set:
    """Parameter names of ``cls.__init__`` and, through ``**kwargs``, of
    its bases'."""
    names = set()
    for klass in cls.__mro__:
        if '__init__' not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names |= {
            p.name
            for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


@RUNNERS.register_module()
class MMDTRRunner(Runner):
    """MMEngine's Runner with mmdtr's config keys and CPU-distributed support.

    Accepts the same arguments as :class:`mmengine.runner.Runner`. Build it
    with :meth:`from_cfg` (or through ``runner_type``) so that mmdtr's memory
    keys are translated into hooks; building it with ``__init__`` directly
    takes ``custom_hooks`` as given.

    Examples:
        >>> # in a downstream repo's config, used by its own tools/train.py
        >>> custom_imports = dict(imports=['mmdtr'],
        ...                       allow_failed_imports=False)
        >>> runner_type = 'MMDTRRunner'  # or 'mmdtr.MMDTRRunner'
        >>> activation_checkpointing = ['backbone.layer1']
    """

    #: model wrapper used by default when distributed on CPU.
    cpu_model_wrapper: str = 'mmdtr.MMDTRDistributedDataParallel'

    def __init__(self, *args, **kwargs):
        register_checkpoint_safe_globals()
        super().__init__(*args, **kwargs)
        if self.distributed and get_device() == 'cpu':
            self.logger.info(
                f'mmdtr: distributed on CPU, backend '
                f'{torch_dist.get_backend()}, world size {self.world_size}, '
                f'model wrapper {type(self.model).__name__}.')

    @classmethod
    def from_cfg(cls, cfg: Union[Config, ConfigDict, dict]) -> 'MMDTRRunner':
        """Build a runner from a config, translating mmdtr's memory keys.

        Args:
            cfg (Config or dict): The config; see
                :meth:`mmengine.runner.Runner.__init__` for its keys.

        Returns:
            MMDTRRunner: The runner.

        Raises:
            MmdtrError: If a memory key has a bad value, or AMP is asked for
                on a CPU-only machine.
        """
        if not isinstance(cfg, Config):
            cfg = Config(dict(cfg))
        cfg = translate_memory_keys(cfg)
        check_amp_available(cfg.get('optim_wrapper'))
        return super().from_cfg(cfg)

    def dump_config(self) -> None:
        """Dump the config as written, with mmdtr's keys, to ``work_dir``
        (see :func:`dump_config_as_written`)."""
        if not dump_config_as_written(self):
            super().dump_config()

    def setup_env(self, env_cfg: Dict) -> None:
        """Set up the environment; on CPU, initialise gloo first.

        MMEngine's ``init_dist`` calls ``torch.cuda.set_device``. Without an
        accelerator the process group is initialised here with
        :func:`~mmdtr.adapters.distributed.init_cpu_dist`; MMEngine's
        ``setup_env`` then skips ``init_dist`` since the group exists.

        Args:
            env_cfg (dict): The ``env_cfg`` of the config.
        """
        if (self.distributed and not is_distributed()
                and get_device() == 'cpu'):
            init_cpu_dist(self.launcher, **dist_cfg_of(env_cfg))
        super().setup_env(env_cfg)

    def wrap_model(self, model_wrapper_cfg: Optional[Dict],
                   model: nn.Module) -> nn.Module:
        """Wrap the model; on CPU, with :attr:`cpu_model_wrapper` by default.

        Args:
            model_wrapper_cfg (dict, optional): The config's
                ``model_wrapper_cfg``; when set it is used as is.
            model (nn.Module): The model to wrap.

        Returns:
            nn.Module: The wrapped model (or the model when not distributed).
        """
        on_cpu = self.distributed and not is_model_wrapper(model) and \
            get_device() == 'cpu'
        if model_wrapper_cfg is None and on_cpu:
            model_wrapper_cfg = dict(
                type=self.cpu_model_wrapper,
                broadcast_buffers=False,
                find_unused_parameters=self.cfg.get('find_unused_parameters',
                                                    False))
        elif isinstance(model_wrapper_cfg, dict):
            model_wrapper_cfg = self._resolvable_wrapper(
                model_wrapper_cfg, on_cpu)
        return super().wrap_model(model_wrapper_cfg, model)

    def _resolvable_wrapper(self, cfg: Dict, on_cpu: bool) -> Dict:
        """``model_wrapper_cfg`` as MMEngine's ``wrap_model`` can build it
        (found by an adversarial search; each failed in every rank):
        MMEngine looks the type up in its root registry, so a plain name
        of mmdtr's gets its scope; on CPU, MMEngine's own DDP wrapper (also
        the default when no type is given) passes CUDA ``device_ids``, so
        :attr:`cpu_model_wrapper`, its subclass without them, is used."""
        cfg = dict(cfg)
        name = cfg.get('type', 'MMDistributedDataParallel')
        if isinstance(name, type):  # MMEngine's wrap_model takes names
            name = cfg['type'] = name.__name__  # scoped below if mmdtr's
        if name in ('MMDistributedDataParallel',
                    'mmengine.MMDistributedDataParallel') and on_cpu:
            cfg['type'] = self.cpu_model_wrapper
        elif name in ('MMSeparateDistributedDataParallel',
                      'mmengine.MMSeparateDistributedDataParallel') \
                and on_cpu:  # the same, for each sub-module (GANs)
            cfg['type'] = 'mmdtr.MMDTRSeparateDistributedDataParallel'
        elif isinstance(name, str) and mmdtr_only(MODEL_WRAPPERS, name):
            cfg['type'] = f'mmdtr.{name}'
        return cfg


def dump_config_as_written(runner: Runner) -> bool:
    """Dump the config as written, with mmdtr's keys, to the work dir.

    A runner trains with the translated config (the keys turned into
    hooks); dumping that would make a restart from the dumped file refuse
    ``--cfg-options`` on the keys as configured twice. The file is the one
    MMEngine's ``Runner.dump_config`` writes, so this replaces its dump.

    Args:
        runner (Runner): A runner whose config
            :func:`~mmdtr.adapters.config_translation.translate_memory_keys`
            made.

    Returns:
        bool: Whether there was a config as written (``False`` for a
        config that was not translated); only the main process writes it.
    """
    source = getattr(runner.cfg, SOURCE_ATTR, None)
    if source is None:
        return False
    if not is_main_process():
        return True
    filename = osp.basename(source.filename) if source.filename \
        is not None else f'{runner.timestamp}.py'
    source.dump(osp.join(runner.work_dir, filename))
    return True


# ``runner_type='MMDTRRunner'`` must resolve under any default scope (e.g. a
# downstream repo's 'mmdet'), so the runner is reachable from MMEngine's root
# registry too; ``'mmdtr.MMDTRRunner'`` resolves to the same class.
if MMENGINE_RUNNERS.get('MMDTRRunner') is None:
    MMENGINE_RUNNERS.register_module(module=MMDTRRunner)
