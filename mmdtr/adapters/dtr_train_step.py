"""DTR for one training step: a fresh engine per iteration.

:class:`DTRTrainStep` runs a model's ``train_step`` with a fresh
:class:`~mmdtr.dtr.DTR` engine per iteration: the engine is entered before
the data preprocessor and the forward, and closed as soon as
``optim_wrapper.backward`` returns, so gradient clipping, the optimizer step
and ``zero_grad`` run without it (and an iteration that only accumulates
gradients closes it too); when the model's ``train_step`` holds a context
entered after the engine around the backward (``save_on_cpu``, a dispatch
mode), at the end of ``train_step`` instead. With several optimizers (an
``OptimWrapperDict``) it spans the whole ``train_step``. An exception
anywhere in the iteration closes it as well: no dispatch mode or
saved-tensor hooks stay on the thread. The engine's statistics of each
iteration go to MMEngine's ``MessageHub`` (:data:`SCALARS`), each the
largest over the ranks when distributed.

:func:`dtr_settings` validates the ``dtr`` settings (:data:`DTR_SUB_KEYS`)
with the engine's own checks; :func:`model_device` gives the device the
engine meters. :class:`~mmdtr.adapters.dtr_hook.DTRHook` runs the step for
any model, and
:class:`~mmdtr.adapters.dtr_model_wrapper.DTRDistributedDataParallel` runs
it per rank; see docs/dtr_training.md.
"""
import difflib
import logging
from typing import Callable, Optional

import torch
from mmengine.dist import all_gather, get_world_size
from mmengine.logging import MessageHub, print_log
from mmengine.optim import OptimWrapper, OptimWrapperDict
from torch import nn

from mmdtr.core.recording_threshold import RecentSteps, batch_bytes
from mmdtr.core.sizes import format_size
from mmdtr.dtr import DTR, POLICIES, DTRStats, engine_active
from mmdtr.errors import MmdtrError

#: The sub-keys of ``dtr`` (the arguments of :class:`~mmdtr.dtr.DTR` that a
#: config sets; the device is the model's).
DTR_SUB_KEYS = ('eviction_threshold', 'evictee_minimum_size',
                'enable_sqrt_sampling', 'policy', 'recording_threshold')
_EXAMPLE = ("dtr=dict(eviction_threshold='2GB', evictee_minimum_size='1MB', "
            "enable_sqrt_sampling=False, policy='dtr', "
            "recording_threshold='auto')")
#: ``recording_threshold`` chosen per iteration from the last one's
#: statistics (:func:`~mmdtr.core.recording_threshold.
#: next_recording_threshold`, design.md R16)
AUTO = 'auto'
#: MessageHub scalar name -> how to get it from the engine's stats (logged:
#: the largest over the ranks)
SCALARS = {
    'train/dtr_peak_memory_mb': lambda s: s.peak_memory / 2**20,
    'train/dtr_evictions': lambda s: s.evictions,
    'train/dtr_recomputations': lambda s: s.recomputations,
    'train/dtr_remat_seconds': lambda s: s.remat_seconds,
    'train/dtr_eviction_failures': lambda s: s.eviction_failures,
    'train/dtr_idle_ops': lambda s: s.idle_ops,
}
_PEAK, _FAILURES = 0, 4  # their places in SCALARS


def dtr_settings(value, key: str = 'dtr', device=None) -> dict:
    """Validate DTR settings from a config with the engine's own checks.

    A :class:`~mmdtr.dtr.DTR` engine is built (not entered) from the
    settings, so everything the engine rejects is rejected here, before
    training starts.

    Args:
        value (dict): Sub-keys of :data:`DTR_SUB_KEYS`; ``eviction_threshold``
            is required unless ``device`` is CUDA.
        key (str): The config key, for error messages. Defaults to ``'dtr'``.
        device (str | torch.device, optional): The device whose memory is
            metered. Defaults to the engine's default, ``None``: the device
            of the first storage an op allocates in scope.

    Returns:
        dict: The settings as given, as a plain dict, without a
        ``policy`` of ``None`` (the default, ``'dtr'``). A
        ``recording_threshold`` left out is ``'auto'``: chosen per
        iteration (:class:`DTRTrainStep`).

    Raises:
        MmdtrError: If ``value`` is not a dict, has unknown sub-keys, or has
            a value the engine rejects (a bad size, a non-bool
            ``enable_sqrt_sampling``, an unknown policy, no threshold on
            CPU).

    Examples:
        >>> dtr_settings(dict(eviction_threshold='3GB'))
        {'eviction_threshold': '3GB'}
    """
    if not isinstance(value, dict):
        raise MmdtrError(
            f'{key}={value!r} ({type(value).__name__}) is not accepted; '
            f'expected a dict with the keys {list(DTR_SUB_KEYS)}.',
            hint=f'e.g. {_EXAMPLE}; leave {key} out (or None) for no DTR.')
    for name in value:
        if name not in DTR_SUB_KEYS:
            close = difflib.get_close_matches(str(name), DTR_SUB_KEYS, n=2)
            raise MmdtrError(
                f'{key}.{name} is not a DTR setting; accepted: '
                f'{list(DTR_SUB_KEYS)}' +
                (f', closest matches: {close}.' if close else '.'),
                hint=f'e.g. {_EXAMPLE}.')
    settings = dict(value)
    policy = settings.get('policy', None)
    if 'policy' in settings and policy is None:
        # the default, as activation_checkpointing's policy=None is; it got
        # the hint for objects (found by an adversarial search)
        del settings['policy']
    if isinstance(policy, str) and policy not in POLICIES:
        # the engine's own hint offers an EvictionPolicy object, which a
        # config refuses (found by a review); 'LRU' got no closest match
        # (another search)
        lowered = {name.lower(): name for name in POLICIES}
        close = [
            lowered[name] for name in difflib.get_close_matches(
                policy.lower(), lowered, n=1)
        ]
        raise MmdtrError(
            f'{key}.policy={policy!r} is not an eviction policy; accepted: '
            f'{sorted(POLICIES)}' +
            (f', closest match: {close[0]!r}.' if close else '.'),
            hint='a policy of your own is accepted by the name it was '
            'registered under (mmdtr.dtr.register_policy) in a module the '
            'config imports (custom_imports).')
    try:
        DTR(device=device, **engine_settings(settings))
    except MmdtrError as e:
        if 'recording_threshold' in e.message:
            e = MmdtrError(
                e.message, f"{e.hint} Or '{AUTO}' (the default): chosen "
                'per iteration' + ('.' if 'None' in e.hint else
                                   '; or None: record from the first op.'))
        raise MmdtrError(
            f'{key}={settings!r} is not accepted: {e.message}',
            hint=e.hint) from None
    return settings


def engine_settings(settings: dict,
                    recent: Optional[RecentSteps] = None,
                    input_bytes: Optional[int] = None) -> dict:
    """The arguments of a :class:`~mmdtr.dtr.DTR` engine from validated
    settings: a ``recording_threshold`` of ``'auto'`` (or left out) is the
    one ``recent`` gives the next iteration (R16), or left out without it.

    Args:
        settings (dict): From :func:`dtr_settings`.
        recent (RecentSteps, optional): The recent iterations' statistics.
        input_bytes (int, optional): The bytes of the next iteration's
            data batch, for ``recent``.

    Returns:
        dict: ``settings`` as they are if they give a recording threshold
        of their own, else a copy with it resolved.
    """
    if not uses_auto(settings):
        return settings
    resolved = dict(settings)
    resolved.pop('recording_threshold', None)
    if recent is not None:
        resolved['recording_threshold'] = recent.next_threshold(input_bytes)
    return resolved


def uses_auto(settings: dict) -> bool:
    """Whether validated settings leave ``recording_threshold`` to
    ``'auto'`` (R16)."""
    return is_auto(settings.get('recording_threshold', AUTO))


def is_auto(value) -> bool:
    """Whether a ``recording_threshold`` is ``'auto'``; compared only when
    it is a string (an array compared element-wise, then raised NumPy's
    "truth value of an array is ambiguous"; found by an adversarial
    search)."""
    return isinstance(value, str) and value == AUTO


def model_device(model: nn.Module) -> Optional[torch.device]:
    """The device of the first parameter of ``model``, or None."""
    for param in model.parameters():
        return param.device
    return None


class DTRTrainStep:
    """Run ``train_step`` with its forward and backward under DTR.

    Each call builds a fresh engine, enters it, runs ``train_step`` and
    closes the engine when ``optim_wrapper.backward`` returns (before
    gradient clipping and the optimizer step), or when ``train_step`` ends
    or raises, whichever comes first. With an ``OptimWrapperDict`` (several
    optimizers, each with its own backward, as GANs train) the engine spans
    the whole ``train_step``, optimizer steps included. The statistics of
    the iteration are :attr:`stats` and go to the ``MessageHub`` as the
    scalars in :data:`SCALARS` (``train/dtr_peak_memory_mb``,
    ``train/dtr_evictions``, ``train/dtr_recomputations``,
    ``train/dtr_remat_seconds``, ``train/dtr_eviction_failures``,
    ``train/dtr_idle_ops``). A ``recording_threshold`` of ``'auto'`` (the
    default) is resolved at each call from the statistics of the recent
    iterations and the bytes of their data batches
    (:class:`~mmdtr.core.recording_threshold.RecentSteps`, design.md R16).

    Args:
        settings (dict): See :func:`dtr_settings`.
        device (str | torch.device, optional): The metered device; the
            model's. Defaults to the engine's default.
        message_hub (MessageHub, optional): Where the statistics go.
            Defaults to ``MessageHub.get_current_instance()`` at each call.
        key (str): The settings' config key, named in an error. Defaults
            to ``'dtr'``.

    Examples:
        >>> step = DTRTrainStep(dict(eviction_threshold='2GB'))
        >>> log_vars = step(model.train_step, data_batch, optim_wrapper)
        >>> step.stats.evictions
    """

    def __init__(self,
                 settings: dict,
                 device=None,
                 message_hub: Optional[MessageHub] = None,
                 key: str = 'dtr'):
        self.settings = dtr_settings(settings, key, device)
        self.device = device
        self.message_hub = message_hub
        #: DTRStats of the latest iteration that ended without an error
        self.stats: Optional[DTRStats] = None
        #: those of the recent such iterations ('auto', R16)
        self.recent = RecentSteps()
        #: whether a threshold not held was logged (once per run)
        self.warned = False
        #: False once detached (DTRHook.after_train): a reference left
        #: behind (a hook that saved the wrapped train_step and put it back)
        #: then runs train_step as it is, with no engine and no statistics
        self.enabled = True

    def __call__(self, train_step: Callable, data, optim_wrapper):
        """Run ``train_step(data, optim_wrapper)`` under a fresh engine."""
        if not self.enabled:
            return train_step(data, optim_wrapper)
        if not isinstance(optim_wrapper, OptimWrapper):
            raise MmdtrError(
                f'DTR runs train_step(data, optim_wrapper) with an '
                f'OptimWrapper or an OptimWrapperDict, got '
                f'{type(optim_wrapper).__name__}.',
                hint='OptimWrapper and its subclasses (AmpOptimWrapper, '
                'OptimWrapperDict, ...) are supported; other '
                'BaseOptimWrapper types are not.')
        if engine_active():
            raise MmdtrError(
                'a DTR engine is already active on this thread; DTR runs '
                'one engine per process (rank), never two nested.',
                hint='configure DTR once: the dtr key, a DTRHook or '
                'model_wrapper_cfg.dtr, and no mmdtr.dtr.enable().')
        # read for 'auto' only (R16)
        size = batch_bytes(data) if uses_auto(self.settings) else None
        engine = DTR(
            device=self.device,
            **engine_settings(self.settings, self.recent, size))
        if isinstance(optim_wrapper, OptimWrapperDict):
            # several backwards (GANs): the engine spans the whole step,
            # optimizer steps included (R7 orders their parameter writes)
            with engine:
                result = train_step(data, optim_wrapper)
        else:
            result = self._close_after_backward(engine, train_step, data,
                                                optim_wrapper)
        self.stats = engine.stats
        self.recent.add(self.stats, size)
        per_rank = _per_rank([get(self.stats) for get in SCALARS.values()])
        self._publish(per_rank)
        failed = [(rank, values) for rank, values in enumerate(per_rank)
                  if values[_FAILURES]]
        if failed and not self.warned and self.stats.threshold is not None:
            self.warned = True
            print_log(
                _not_held(self.stats.threshold, failed, len(per_rank)),
                'current', logging.WARNING)
        return result

    @staticmethod
    def _close_after_backward(engine, train_step, data, optim_wrapper):
        had_own = 'backward' in vars(optim_wrapper)
        backward = optim_wrapper.backward

        def close():
            if engine.active:
                engine.__exit__(None, None, None)

        def backward_then_close(loss, **kwargs):
            try:
                return backward(loss, **kwargs)
            finally:
                # before gradient clipping and the step; after train_step
                # where the model entered a context around its step
                # (save_on_cpu: closing here would be refused; a review)
                if engine.closable:
                    close()

        optim_wrapper.backward = backward_then_close
        try:
            engine.__enter__()
            return train_step(data, optim_wrapper)
        finally:
            try:
                close()
            finally:
                if had_own:
                    optim_wrapper.backward = backward
                else:
                    del optim_wrapper.backward

    def _publish(self, per_rank: list) -> None:
        """Put each scalar's largest value over the ranks in the hub."""
        hub = self.message_hub or MessageHub.get_current_instance()
        for i, name in enumerate(SCALARS):
            # not resumed: an iteration's figures are no training state,
            # and a run resumed without DTR would log the checkpoint's
            hub.update_scalar(
                name, max(values[i] for values in per_rank), resumed=False)


def _per_rank(values: list) -> list:
    """``values`` (the scalars of :data:`SCALARS`, in order) of every rank,
    all-gathered after each iteration; this rank's alone when not
    distributed. Rank 0 writes the log: with its own figures alone,
    another rank that did not hold its threshold went unseen (found by an
    adversarial search). One small collective per iteration, after the
    engine's scope; every rank runs it, as every rank runs the step."""
    if get_world_size() < 2:
        return [values]
    gathered = all_gather(torch.tensor(values, dtype=torch.float64))
    return [[type(v)(x) for v, x in zip(values, t.tolist())] for t in gathered]


def _not_held(threshold: int, failed: list, ranks: int) -> str:
    """The warning for ``failed``, ``(rank, scalars)`` of the ranks whose
    iteration had eviction failures, out of ``ranks``; the figures are the
    largest of theirs, as logged."""
    peak = format_size(max(values[_PEAK] for _, values in failed) * 2**20)
    failures = int(max(values[_FAILURES] for _, values in failed))
    where, logged = '', ''
    if ranks > 1:
        where = f' on rank {failed[0][0]}' if len(failed) == 1 else \
            f' on ranks {[rank for rank, _ in failed]}'
        logged = ', the largest over the ranks'
    return (f'mmdtr: dtr.eviction_threshold ({format_size(threshold)}) '
            f'was not held in this iteration{where}: memory in use rose to '
            f'{peak} with nothing evictable left ({failures} eviction '
            'failures). Below what must stay resident (gradients, tensors '
            'held from Python, the op running) rebuilds grow fast, the step '
            "slows, and the peak can pass that of a step without DTR (a "
            f"rebuild's inputs are remade too): raise it to '{peak}' or "
            'more, or train without DTR if that fits '
            f'(train/dtr_eviction_failures counts each iteration{logged}; '
            'this is logged once).')


__all__ = [
    'DTR_SUB_KEYS', 'SCALARS', 'DTRTrainStep', 'dtr_settings',
    'engine_settings', 'model_device'
]
