"""The config checks of :class:`~mmdtr.adapters.runner.MMDTRRunner`: the
runner and model types, the optimizer wrappers and their optimizers' types,
AMP on a machine without CUDA, and distributed training on a CPU-only
machine.

Each ``@config_check`` runs when the config is translated, before the
runner and its work dir are built: MMEngine would meet these settings only
in ``runner.train()`` (or once per rank), in a traceback.
"""
import difflib
import inspect
import multiprocessing
import platform
from typing import Optional

from mmengine.device import (get_device, is_cuda_available, is_mlu_available,
                             is_npu_available)
from mmengine.utils.dl_utils import set_multi_processing

from mmdtr.errors import MmdtrError
from mmdtr.registry import MODELS, OPTIM_WRAPPERS, OPTIMIZERS, RUNNERS
from .config_translation import config_check, refuse_unless_dict
from .cpu_process_group import check_cpu_dist_cfg, dist_cfg_of
from .inplace_optim_settings import (BUILDER_KEYS, check_accumulative_counts,
                                     check_wrapper_config, clip_grad_settings)
from .optimizer_values import check_optimizer_values, refuse_missing_optimizer
from .registered_types import (check_scoped_type, mmdtr_only, of_another_scope,
                               refuse_unregistered)
from .setting_values import argument_names, check_keys


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
    for key, wrapper in _wrapper_cfgs(optim_wrapper):
        if _is_amp(wrapper.get('type')):
            raise MmdtrError(
                f"{key}.type={wrapper.get('type')!r} (AMP, e.g. from "
                '--amp) needs a CUDA, NPU or MLU device, but none is '
                "available; MMEngine's AmpOptimWrapper cannot run on CPU.",
                hint=f"drop --amp, or use {key}.type='OptimWrapper'.")


def _wrapper_cfgs(optim_wrapper) -> list:
    """``(key, config)`` of each optimizer-wrapper config of
    ``optim_wrapper`` (one, or a dict of them, one per optimizer:
    ``optim_wrapper.generator``, for messages; found by an adversarial
    search, which read ``optim_wrapper.accumulative_counts``)."""
    if not isinstance(optim_wrapper, dict):
        return []
    if 'type' not in optim_wrapper and 'optimizer' not in optim_wrapper:
        return [(f'optim_wrapper.{name}', w)
                for name, w in optim_wrapper.items() if isinstance(w, dict)]
    return [('optim_wrapper', optim_wrapper)]


def _is_inplace(wrapper_type) -> bool:
    """Whether the type is ``InplaceOptimWrapper`` itself (a subclass may
    take arguments of its own: its constructor checks them)."""
    from .inplace_optim_wrapper import InplaceOptimWrapper
    if isinstance(wrapper_type, str) and '.' in wrapper_type and \
            not wrapper_type.startswith('mmdtr.'):
        return False  # another scope's (_check_wrapper_keys names it)
    return _is_wrapper(wrapper_type, InplaceOptimWrapper)


@config_check
def check_runner_type(cfg, custom_hooks: list) -> None:
    """Check ``runner_type``: a class, or a registered name.

    Raises:
        MmdtrError: On another value, or a name of mmdtr's or MMEngine's
            scope that is not registered (``MMDTRrunner``).
    """
    runner_type = cfg.get('runner_type', None)
    if runner_type is None or inspect.isclass(runner_type):
        return
    if not isinstance(runner_type, str):
        raise MmdtrError(
            f'runner_type={runner_type!r} is not accepted: a registered '
            'runner name or a runner class.',
            hint="e.g. runner_type='MMDTRRunner' (or 'mmdtr.MMDTRRunner'), "
            "or leave it out: tools/train.py builds mmdtr's runner.")
    refuse_unregistered(
        'runner_type',
        runner_type,
        RUNNERS,
        cfg.get('default_scope', None),
        in_scope=False)


@config_check
def check_model_type(cfg, custom_hooks: list) -> None:
    """Check ``model.type``: a name of mmdtr's or MMEngine's scope that is
    not registered failed when the runner built the model, after its work
    dir was made, in a traceback, and ``--check-config`` passed it when no
    module name made it build the model (found by a new-user walkthrough).

    Raises:
        MmdtrError: On a model config without a type, or a type name of
            mmdtr's or MMEngine's scope that is not registered
            (``ResNetClasifier``).
    """
    model = cfg.get('model', None)
    if not isinstance(model, dict):
        return  # a module, or none: the runner says
    if model.get('type', None) is None:
        raise MmdtrError(
            f'model={model!r} has no type.',
            hint="name the model to build, e.g. model=dict("
            "type='ResNetClassifier', depth=50, num_classes=1000).")
    default_scope = cfg.get('default_scope', None)
    # an mmdtr model by its plain name outside mmdtr's scope: the message
    # says where MMEngine looks (found by a review)
    check_scoped_type('model', model, MODELS, default_scope)
    refuse_unregistered(
        'model.type',
        model['type'],
        MODELS,
        model.get('_scope_', None) or default_scope,
        list_parent=False)


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
def check_mp_cfg(cfg, custom_hooks: list) -> None:
    """Check ``env_cfg.mp_cfg``, which MMEngine's runner passes to
    ``set_multi_processing`` as it sets up: an unknown key or start method
    raised a raw error there, after the work dir was made, once per rank
    under a launcher (found by an adversarial search).

    Args:
        cfg (Config): The config.
        custom_hooks (list): Its hooks (unused).

    Raises:
        MmdtrError: On a key ``set_multi_processing`` does not take, or a
            ``mp_start_method`` this platform does not have.
    """
    env_cfg = cfg.get('env_cfg', None)
    if not isinstance(env_cfg, dict):
        return  # MMEngine's and the launcher check's to name
    example = "e.g. env_cfg = dict(mp_cfg=dict(mp_start_method='fork'))"
    if 'mp_cfg' not in env_cfg:
        return
    mp_cfg = env_cfg['mp_cfg']
    if not isinstance(mp_cfg, dict):  # None too: MMEngine's ** of it
        raise MmdtrError(
            f'env_cfg.mp_cfg={mp_cfg!r} is not accepted: MMEngine takes a '
            'dict of set_multi_processing arguments.',
            hint=f'leave mp_cfg out for its defaults, or give a dict: '
            f'{example}.')
    # the runner passes distributed itself
    accepted = [
        n for n in argument_names(set_multi_processing, 0)
        if n != 'distributed'
    ]
    check_keys(mp_cfg, accepted, 'env_cfg.mp_cfg',
               'an argument of set_multi_processing', mp_cfg, example)
    methods = multiprocessing.get_all_start_methods()
    method = mp_cfg.get('mp_start_method', 'fork')  # None: the default
    if platform.system() != 'Windows' and method is not None \
            and method not in methods:
        raise MmdtrError(
            f'env_cfg.mp_cfg.mp_start_method={method!r} is not a start '
            f'method of this platform; accepted: {", ".join(methods)}.',
            hint=example + '.')


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
    for key, wrapper in _wrapper_cfgs(optim_wrapper):
        check_scoped_type(key, wrapper, OPTIM_WRAPPERS, default_scope)
        built_by_default = default and _default_constructor(wrapper)
        if built_by_default:
            _check_optimizer_key(wrapper, default_scope, key)
        if _is_inplace(wrapper.get('type')):
            check_wrapper_config(wrapper, distributed, key)
            continue
        if built_by_default and ('type' in wrapper or 'optimizer' in wrapper):
            _check_wrapper_keys(wrapper, default_scope, key)
        if 'accumulative_counts' in wrapper:
            check_accumulative_counts(wrapper['accumulative_counts'], False,
                                      key)
        if amp_convertible(wrapper.get('type', 'OptimWrapper')):
            # MMEngine's own: an assertion or a ValueError in train()
            clip_grad_settings(wrapper.get('clip_grad', None), False, key)
    if default and optim_wrapper:  # after its wrappers' own keys
        refuse_missing_optimizer(optim_wrapper)


def _check_optimizer_key(wrapper: dict, default_scope, key: str) -> None:
    """The default constructor builds ``optimizer`` from a dict (anything
    else failed in ``runner.train()`` with an AttributeError) with a
    registered type."""
    optimizer = wrapper.get('optimizer', None)
    if 'optimizer' in wrapper and not isinstance(optimizer, dict):
        raise MmdtrError(
            f'{key}.optimizer={optimizer!r} is not accepted: '
            "MMEngine's default constructor builds it from a dict with a "
            'type.',
            hint="e.g. optimizer=dict(type='SGD', lr=0.01, momentum=0.9).")
    if isinstance(optimizer, dict):
        optimizer_type = optimizer.get('type', None)
        scope = optimizer.get('_scope_', None) or default_scope
        # a class, or the one MMEngine's builder finds by that name (None
        # for another scope's, which may register its own class by that
        # name: found by a review). The default constructor looks the name
        # up in the config's scope, whatever the optimizer's _scope_, then
        # builds it in its _scope_: both must find it (a review)
        where = f'{key}.optimizer.type'
        if inspect.isclass(optimizer_type):
            cls = optimizer_type
        else:
            cls = refuse_unregistered(where, optimizer_type, OPTIMIZERS,
                                      default_scope)
            if scope != default_scope:  # the class built, whose arguments
                # count
                cls = refuse_unregistered(where, optimizer_type, OPTIMIZERS,
                                          scope)
        if cls is not None:
            _check_optimizer_arguments(optimizer, cls, f'{key}.optimizer')


def _check_optimizer_arguments(optimizer: dict, cls, key: str) -> None:
    """Refuse a key ``cls`` does not take (``accumulative_counts`` one level
    too deep: a raw TypeError of the optimizer's ``__init__`` in
    ``runner.train()``; found by a review). An ``__init__`` with
    ``**kwargs`` may take anything: not checked."""
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params):
        return
    accepted = sorted({p.name for p in params} - {'self'})
    check_keys(
        optimizer,
        accepted + ['_scope_', 'type'],
        key,
        f'an argument of {cls.__name__}',
        values=optimizer,
        example='accumulative_counts and clip_grad belong to optim_wrapper '
        'itself' if {'accumulative_counts', 'clip_grad'}
        & set(optimizer) else '')
    check_optimizer_values(optimizer, cls, key)


def _check_wrapper_keys(wrapper: dict, default_scope, key: str) -> None:
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
        if of_another_scope(
                str(wrapper_type),
                wrapper.get('_scope_', None) or default_scope):
            return
        name = str(wrapper_type).rpartition('.')[2]
        known = sorted(
            {*OPTIM_WRAPPERS.module_dict, *OPTIM_WRAPPERS.parent.module_dict})
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if close:
            ours = mmdtr_only(OPTIM_WRAPPERS, close[0])
            raise MmdtrError(
                f'{key} type={wrapper_type!r} is not registered.',
                hint=f'closest match: '
                f"{'mmdtr.' + close[0] if ours else close[0]!r}; "
                f'registered: {known}.')
        return  # not close to any: MMEngine names it
    check_keys(
        wrapper,
        sorted({*BUILDER_KEYS, *_init_parameters(cls)} - {'self'}),
        key,
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
