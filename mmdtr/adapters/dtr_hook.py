"""MMEngine adapter of DTR: the ``dtr`` config key and :class:`DTRHook`.

The engine is :class:`mmdtr.dtr.DTR`; one training step under it is
:class:`~mmdtr.adapters.dtr_train_step.DTRTrainStep`. The hook decides
who runs that step, once, before training:

- if the model is a
  :class:`~mmdtr.adapters.dtr_model_wrapper.DTRDistributedDataParallel`,
  the hook gives it the settings and the wrapper runs the engine in its
  ``train_step`` (one engine per rank);
- otherwise (a single-process model, or another DDP wrapper such as the
  ones MMEngine and ``MMDTRRunner`` use by default) the hook runs the same
  step around ``runner.model.train_step`` itself, again one engine per
  process.

Either way there is one engine per process, entered for the forward and
backward of each training iteration only (for its whole ``train_step`` with
several optimizers; see :class:`DTRTrainStep`).
"""
import functools
import os
from typing import Mapping, Optional, Union

from mmengine.hooks import Hook
from mmengine.runner import BaseLoop

from mmdtr.core.allocation_failures import allocator_settings
from mmdtr.dtr import POLICIES, DTRStats
from mmdtr.errors import MmdtrError
from mmdtr.registry import HOOKS, MODEL_WRAPPERS
from .config_translation import (config_check, hook_name, memory_key,
                                 refuse_unless_dict)
from .dtr_model_wrapper import DTRDistributedDataParallel
from .dtr_train_step import (AUTO, DTRTrainStep, dtr_settings, is_auto,
                             model_device)
from .registered_types import check_registered_type, check_scoped_type

KEY = 'dtr'


def expandable_segments_hint(device,
                             environ: Mapping[str, str] = os.environ
                             ) -> Optional[str]:
    """The advice logged when DTR trains on CUDA without expandable
    segments, or ``None``: DTR frees activations all through the step,
    and the default caching allocator then holds free memory in blocks too
    small for the next large request (docs/dtr.md, "CUDA").

    Args:
        device: The model's device (``torch.device``, a string or None).
        environ (Mapping): The environment to read.
    """
    if device is None or 'cuda' not in str(device):
        return None
    if 'expandable_segments:true' in allocator_settings(environ):
        return None
    return ('mmdtr: DTR on CUDA fits larger batches with '
            'PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before '
            'the process starts: the default allocator fragments (ResNet-50 '
            'at 224x224 on an emulated 11 GB card: 456 on an H100 and under '
            '432 on an H200 without it, 596 with it; see docs/dtr.md).')


@memory_key(KEY, hook='DTRHook', once=True)
def translate_dtr(value) -> dict:
    """Validate the ``dtr`` value and build the :class:`DTRHook` config.

    The settings are checked by building a :class:`~mmdtr.dtr.DTR` engine
    (not entering it) on the default device, so bad values fail before the
    runner is built.

    Args:
        value (dict): ``eviction_threshold``, ``evictee_minimum_size``,
            ``enable_sqrt_sampling``, ``policy``; see :class:`DTRHook`.

    Returns:
        dict: The config of :class:`DTRHook`.

    Raises:
        MmdtrError: On a non-dict value, an unknown sub-key (with the
            closest matches), a bad size or type, an unknown policy, or no
            threshold on a machine without CUDA.

    Examples:
        >>> dtr = dict(eviction_threshold='3GB')
        >>> dtr = dict(eviction_threshold='3GB', evictee_minimum_size='4MB',
        ...            enable_sqrt_sampling=True, policy='dtr')
        >>> # from the command line
        >>> # --cfg-options dtr.eviction_threshold=3GB
    """
    policy = value.get('policy') if isinstance(value, Mapping) else None
    if isinstance(policy, (bool, int, float)):  # a value, not an object
        raise MmdtrError(
            f'{KEY}.policy={policy!r} is not accepted: a policy name '
            f'({sorted(POLICIES)} or one registered).',
            hint=f"e.g. {KEY}.policy='lru'.")
    if policy is not None and not isinstance(policy, str):
        # the config dump failed on an object, in a raw traceback after the
        # work dir was made (found by an adversarial search); checked
        # before the engine's own, whose hint offers an EvictionPolicy
        # object (found by a new-user walkthrough)
        raise MmdtrError(
            f"{KEY}.policy={value['policy']!r} is not accepted in a "
            f'config: it is written to the work dir, which takes names '
            f'({sorted(POLICIES)} or one registered), not objects.',
            hint='register the class with mmdtr.dtr.register_policy (in a '
            "module the config's custom_imports imports) and give its "
            'name.')
    return dict(type='mmdtr.DTRHook', **dtr_settings(value, KEY))


def _compile_refused(compiled) -> MmdtrError:
    return MmdtrError(
        f'compile={compiled!r} and DTR cannot be combined: the compiled '
        "train_step would trace through DTR's dispatch mode.",
        hint=f'drop compile (compile={None}) or DTR.')


@config_check
def check_dtr_combinations(cfg, custom_hooks: list) -> None:
    """Refuse, before the runner is built, what cannot run with DTR.

    - MMEngine's ``compile`` key: the compiled ``train_step`` would trace
      through the engine's dispatch mode, which fails inside PyTorch;
    - ``model_wrapper_cfg.dtr`` together with the ``dtr`` key or a
      :class:`DTRHook` (configured twice), or without a launcher (MMEngine
      wraps the model only when distributed, so it would be ignored), or
      with values the engine refuses (checked here, not when the model is
      wrapped after the process group is set up);
    - a plain ``model_wrapper_cfg.type`` of mmdtr's in another scope (see
      :func:`~.registered_types.check_scoped_type`).

    Args:
        cfg (Config): The config.
        custom_hooks (list): Its hooks, the translated keys' included.

    Raises:
        MmdtrError: On one of the combinations above.
    """
    hooks = [h for h in custom_hooks if hook_name(h) == 'DTRHook']
    wrapper = cfg.get('model_wrapper_cfg', None)
    refuse_unless_dict(
        'model_wrapper_cfg', wrapper, 'a dict',
        "e.g. model_wrapper_cfg=dict(type='mmdtr."
        "DTRDistributedDataParallel', dtr=dict(eviction_threshold="
        "'3GB')); on the command line set its keys: "
        'model_wrapper_cfg.type=...')
    wrapper_cls = None
    if isinstance(wrapper, dict):
        check_scoped_type('model_wrapper_cfg', wrapper, MODEL_WRAPPERS,
                          cfg.get('default_scope', None))
        wrapper_cls = _wrapper_class(wrapper.get('type', None))
    by_wrapper = wrapper.get('dtr', None) if isinstance(wrapper,
                                                        dict) else None
    compiled = cfg.get('compile', None)
    if compiled not in (None, False) and (hooks or by_wrapper is not None):
        raise _compile_refused(compiled)
    if by_wrapper is None:
        if not hooks and cfg.get('launcher', 'none') != 'none' and \
                _is_dtr_wrapper(wrapper_cls):
            # it trained as plain DDP, silently (found by an adversarial
            # search)
            raise MmdtrError(
                f"model_wrapper_cfg.type={wrapper['type']!r} without DTR "
                'settings: neither model_wrapper_cfg.dtr nor the dtr key is '
                'given, so DTR would be off.',
                hint='add the dtr key (or model_wrapper_cfg.dtr), or use '
                "MMEngine's MMDistributedDataParallel.")
        return
    if hooks:
        raise MmdtrError(
            f'DTR is configured twice: model_wrapper_cfg.dtr={by_wrapper!r} '
            f'and {hooks[0]!r}.',
            hint='keep either the dtr key or model_wrapper_cfg.dtr.')
    if cfg.get('launcher', 'none') == 'none':
        raise MmdtrError(
            f'model_wrapper_cfg.dtr={by_wrapper!r} with launcher='
            f"{cfg.get('launcher', 'none')!r}: MMEngine wraps the model only "
            'in distributed training, so DTR would be off.',
            hint='use the top-level dtr key, which works with and without '
            'a launcher.')
    dtr_settings(by_wrapper, 'model_wrapper_cfg.dtr')  # its values, now
    wrapper_type = wrapper.get('type', None)
    if wrapper_cls is None and wrapper_type is not None and '.' in str(
            wrapper_type) and not str(wrapper_type).startswith(
                ('mmdtr.', 'mmengine.')):
        return  # another project's wrapper, maybe not imported yet
    if not _is_dtr_wrapper(wrapper_cls):
        raise MmdtrError(
            f'model_wrapper_cfg.dtr={by_wrapper!r} on model_wrapper_cfg.type='
            f'{wrapper_type!r}: only DTRDistributedDataParallel (and its '
            'subclasses) takes a dtr argument; this wrapper would fail when '
            'the runner is built.',
            hint="set model_wrapper_cfg.type='mmdtr.DTRDistributedDataParallel"
            "', or use the top-level dtr key.")


def _wrapper_class(wrapper_type) -> Optional[type]:
    """The class ``model_wrapper_cfg.type`` names, or None if unknown.

    Raises:
        MmdtrError: If it is not registered and names mmdtr's scope
            (``'mmdtr.X'``) or is close to one of mmdtr's wrappers: a typo,
            accepted before and failing in every rank.
    """
    if not isinstance(wrapper_type, str):
        return wrapper_type
    check_registered_type('model_wrapper_cfg', wrapper_type, MODEL_WRAPPERS,
                          'model wrapper')
    return MODEL_WRAPPERS.get(wrapper_type)


def _is_dtr_wrapper(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls,
                                                DTRDistributedDataParallel)


@HOOKS.register_module()
class DTRHook(Hook):
    """Train with Dynamic Tensor Rematerialization (DTR).

    Each training iteration's data preprocessing, forward and backward run
    under a fresh :class:`~mmdtr.dtr.DTR` engine, closed before gradient
    clipping and the optimizer step, and also on iterations that only
    accumulate gradients or that raise (with several optimizers, see
    :class:`~mmdtr.adapters.dtr_train_step.DTRTrainStep`). Validation and
    test loops never run under it. Per iteration, the peak memory (MiB),
    evictions, recomputations, rebuild time and eviction failures go to the
    message hub as ``train/dtr_*`` scalars, shown by ``LoggerHook`` and the
    visualizer backends.

    Args:
        eviction_threshold (int | str | None): Evict while the memory in use
            is above it, e.g. ``'3GB'`` (binary units) or bytes. Required on
            CPU, where the memory in use is the storages allocated during the
            iteration (activations, gradients, rebuilt tensors; not the
            parameters or optimizer states allocated before). On CUDA it is
            ``torch.cuda.memory_allocated()``; None evicts only when an
            allocation fails.
        evictee_minimum_size (int | str): Smaller storages are never
            evicted. Defaults to 1 MiB.
        enable_sqrt_sampling (bool): Score about sqrt(N) sampled candidates
            per eviction. Defaults to False.
        policy (str | None): ``'dtr'``, ``'dtr_local'``, ``'lru'``,
            ``'largest'``, or a name registered with
            :func:`mmdtr.dtr.register_policy`; ``None`` means ``'dtr'``.
            Defaults to ``'dtr'``.
        recording_threshold (int | str | None): ``'auto'`` (default):
            after iterations none of which evicted or failed to (up to the
            last 8), an iteration runs its ops as they are, metered, until
            memory in use passes their highest peak (at most half the
            threshold), and records from there on; the first iteration,
            those after an eviction, one whose data batch holds more
            tensor bytes than those before, and all without a threshold
            (CUDA) record from the first op (design.md R16). A size:
            record once memory in use passes it. ``None``: always from the
            first op.

    Examples:
        >>> dtr = dict(eviction_threshold='3GB')  # the config key, or:
        >>> custom_hooks = [
        ...     dict(type='mmdtr.DTRHook', eviction_threshold='3GB')
        ... ]
    """

    priority = 'NORMAL'

    def __init__(self,
                 eviction_threshold: Union[int, str, None] = None,
                 evictee_minimum_size: Union[int, str] = 2**20,
                 enable_sqrt_sampling: bool = False,
                 policy='dtr',
                 recording_threshold: Union[int, str, None] = 'auto'):
        self.settings = dict(
            eviction_threshold=eviction_threshold,
            evictee_minimum_size=evictee_minimum_size,
            enable_sqrt_sampling=enable_sqrt_sampling,
            policy=policy)
        if not is_auto(recording_threshold):  # implicit, as in dtr=
            self.settings['recording_threshold'] = recording_threshold
        dtr_settings(self.settings, 'DTRHook')
        self.step: Optional[DTRTrainStep] = None
        self._attached_to = self._own_train_step = self._wrapper = None

    @property
    def stats(self) -> Optional[DTRStats]:
        """The engine's statistics of the latest training iteration."""
        return None if self.step is None else self.step.stats

    def before_run(self, runner) -> None:
        """Make sure the engine is detached when training ends, also by an
        exception: MMEngine calls no hook then, and a model trained again
        by another runner would still run under this one's engine."""
        loop = getattr(runner, '_train_loop', None)
        if not isinstance(loop, BaseLoop) or 'run' in vars(loop):
            return  # not training (val, test), or already done
        # MMDTRRunner refused it with the config; a stock Runner compiles
        # train_step after before_run, and the second iteration failed
        # inside PyTorch
        compiled = runner.cfg.get('compile', None)
        if compiled not in (None, False):
            raise _compile_refused(compiled)

        def run_then_detach(*args, **kwargs):
            try:
                return run(*args, **kwargs)
            finally:
                self._detach()
                del loop.run  # the class's own again (and no cycle)

        run = loop.run
        loop.run = run_then_detach

    def before_train(self, runner) -> None:
        """Attach the engine to the training step of ``runner.model``."""
        self._detach()  # left attached by a run that raised
        model = runner.model
        device = model_device(model)
        if isinstance(model, DTRDistributedDataParallel):
            self.step = model.enable_dtr(self.settings, runner.message_hub)
            self._attached_to = model
            where = f'{type(model).__name__}.train_step, one engine per rank'
        else:
            self.step = DTRTrainStep(self.settings, device, runner.message_hub)
            # a train_step set on the instance is the user's: put it back
            self._own_train_step = vars(model).get('train_step')
            self._wrapper = functools.partial(self.step, model.train_step)
            model.train_step = self._wrapper
            self._attached_to = model
            where = f'{type(model).__name__}.train_step (by DTRHook)'
        # the recording threshold shown also where 'auto' is implicit (R16)
        shown = dict(self.settings)
        shown.setdefault('recording_threshold', AUTO)
        runner.logger.info(
            f'Enabling the "{KEY}" feature (mmdtr) on {device}: '
            f'{shown}, in {where}; each training iteration runs '
            'under DTR.')
        hint = expandable_segments_hint(device)
        if hint is not None:
            runner.logger.info(hint)

    def after_train(self, runner) -> None:
        """Detach the engine: later calls of ``train_step`` run without."""
        self._detach()

    def _detach(self) -> None:
        model, self._attached_to = self._attached_to, None
        wrapper, self._wrapper = self._wrapper, None
        if isinstance(model, DTRDistributedDataParallel):
            model.disable_dtr()
            return
        if wrapper is not None:
            # inert wherever it is left: a hook that wrapped train_step
            # after this one and puts its saved one back in its after_train
            # (called after this one's) restored this wrapper, and the
            # model trained under this engine ever after (found by an
            # adversarial search)
            wrapper.func.enabled = False
        if model is None or vars(model).get('train_step') is not wrapper:
            return  # wrapped again since: the other wrapper's to undo
        if self._own_train_step is not None:
            model.train_step = self._own_train_step
        else:
            del model.train_step  # the class's own again
