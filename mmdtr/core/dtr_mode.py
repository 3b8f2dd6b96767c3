"""The public DTR engine: a context manager over one :class:`EngineState`.

As ``FlopCounterMode`` does, the public façade :class:`DTR` owns the state
and a private, nearly empty ``TorchDispatchMode`` that forwards every op to
it; the saved-tensor hooks are thin closures over the same state.
"""
import difflib
import threading
from typing import Optional, Union

import torch
from torch.utils._python_dispatch import (TorchDispatchMode,
                                          _get_current_dispatch_mode_stack)

from mmdtr.errors import MmdtrError
from . import collector
from .accounting import oom_eviction_needs_cuda
from .dtr_stats import DTRStats, stats_of
from .engine import EngineState
from .idle_ops import DeferredHooks, check_recording_threshold
from .policies import build_policy
from .records import _PLAIN
from .saved_tensors import graph_task_id
from .sizes import parse_size
from .torch_compat import hooks_on_top, outer_saved_tensor_hooks

_DEVICE_TYPES = ('cpu', 'cuda')
_ACTIVE = threading.local()  # .engine: the engine active on this thread
_PLAIN_TYPES = frozenset(_PLAIN)


class _DTRDispatchMode(TorchDispatchMode):

    def __init__(self, state: EngineState):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with self.state.lock:  # (R12)
            if not _PLAIN_TYPES.issuperset(types):  # subclasses: as they are
                return self.state.on_subclass_op(func, args, kwargs or {})
            return self.state.on_op(func, args, kwargs or {})


def _locked(lock, method):
    """``method`` as a saved-tensor hook that holds ``lock``: autograd may
    unpack in another thread than the engine's (R12)."""

    def hook(value):
        with lock:
            return method(value)

    return hook


class DTR:
    """Dynamic Tensor Rematerialization for the code in its scope.

    Args:
        eviction_threshold (int | str | None): Evict while memory in use is
            above it (``'5GB'``, ``'512MiB'``, bytes). ``None`` or 0: evict
            only when an allocation fails, which needs CUDA; on CPU a
            threshold is required.
        evictee_minimum_size (int | str): Smaller storages are never
            evicted. Defaults to 1 MiB.
        enable_sqrt_sampling (bool): Score about sqrt(N) sampled candidates
            per eviction instead of all. Defaults to False.
        policy (str | EvictionPolicy): ``'dtr'`` (default), ``'dtr_local'``,
            ``'lru'``, ``'largest'``, a name given by
            :func:`~mmdtr.core.policies.register_policy`, or an instance.
        device (str | torch.device, optional): Device whose memory is
            metered: ``'cpu'``, ``'cuda'``, ``'cuda:N'`` or a
            ``torch.device`` of those types. Defaults to the device of the
            first storage an op allocates in scope (a CUDA device: its
            ``memory_allocated``).
        recording_threshold (int | str | None): Record ops only once memory
            in use passes it: before that they run as they do without DTR,
            metered, and what they allocate is never evicted (R16). Below
            ``eviction_threshold``. ``None`` or 0 (default): record from
            the first op.
        **unknown: Refused: a misspelt argument (``eviction_treshold``)
            raises :class:`MmdtrError` naming it and the closest argument.

    Raises:
        MmdtrError: If an argument is invalid or unknown (at construction),
            or, at
            ``__enter__``, if another engine is already active on this
            thread: engines do not nest, whether started by ``with DTR()``
            or :func:`mmdtr.dtr.enable`. Engines in other threads are
            independent.

    Examples:
        >>> with DTR(eviction_threshold='2GB') as engine:
        ...     loss = model(x).sum()
        ...     loss.backward()
        >>> engine.stats.evictions
    """

    def __init__(self,
                 eviction_threshold: Union[int, str, None] = None,
                 evictee_minimum_size: Union[int, str] = 2**20,
                 enable_sqrt_sampling: bool = False,
                 policy='dtr',
                 device=None,
                 recording_threshold=None,
                 **unknown):
        if unknown:
            _refuse_unknown_arguments(unknown)
        threshold = parse_size(
            eviction_threshold, 'eviction_threshold', allow_none=True)
        self.eviction_threshold = threshold or None
        self.evictee_minimum_size = parse_size(evictee_minimum_size,
                                               'evictee_minimum_size')
        if not isinstance(enable_sqrt_sampling, bool):
            raise MmdtrError(
                f'enable_sqrt_sampling={enable_sqrt_sampling!r} is not a '
                'bool.', 'Use True or False.')
        self.enable_sqrt_sampling = enable_sqrt_sampling
        self.policy = build_policy(policy)
        self.device = device = _check_device(device)
        self.recording_threshold = check_recording_threshold(
            recording_threshold, self.eviction_threshold)
        needs_cuda = device.type != 'cuda' if device is not None else \
            not torch.cuda.is_available()
        if self.eviction_threshold is None and needs_cuda:
            where = device.type if device is not None else 'a machine ' \
                'without CUDA'
            raise oom_eviction_needs_cuda(eviction_threshold, where)
        self._state = self._mode = self._hooks = None
        self._stats = self._collector = self._thread = None

    def __enter__(self):
        if self._state is not None:
            raise MmdtrError('this DTR engine is already active.',
                             'Create one DTR object per scope.')
        _refuse_in_backward('start')
        _refuse_nesting()
        _refuse_inside_saved_tensor_hooks()
        state = EngineState(self.eviction_threshold, self.evictee_minimum_size,
                            self.enable_sqrt_sampling, self.policy,
                            self.device, self.recording_threshold)
        mode = _DTRDispatchMode(state)
        hooks = DeferredHooks(
            torch.autograd.graph.saved_tensors_hooks(
                _locked(state.lock, state.pack),
                _locked(state.lock, state.unpack)),
            defer=state.recording_threshold is not None)
        if hooks.deferred:  # pushed when recording starts (R16)
            state.ready_to_record = hooks.enter_if_clear
        self._collector = None  # a reused engine's was called at its exit
        try:  # nothing left behind by an error or interrupt in here
            mode.__enter__()
            hooks.enter()
            self._collector = collector.space_collections(self)  # (R1)
            self._state, self._mode, self._hooks = state, mode, hooks
            self._thread = threading.get_ident()
            _ACTIVE.engine = self
        except BaseException:
            self._undo_enter(mode, hooks)
            raise
        return self

    def _undo_enter(self, mode, hooks) -> None:
        """Undo what a failed ``__enter__`` did: ``with`` calls no
        ``__exit__`` then, and an interrupt there left the engine's mode
        and hooks on the thread, and every later engine refused (found by
        an adversarial search)."""
        if getattr(_ACTIVE, 'engine', None) is self:
            _ACTIVE.engine = None
        self._state = self._mode = self._hooks = None
        try:
            hooks.exit()
        finally:
            try:
                stack = _get_current_dispatch_mode_stack()
                if stack and stack[-1] is mode:
                    mode.__exit__(None, None, None)
            finally:
                if self._collector is not None:
                    collector_done, self._collector = self._collector, None
                    collector_done()

    def __exit__(self, exc_type, exc, tb):
        """Pop the hooks and the mode, and freeze :attr:`stats`.

        Raises:
            MmdtrError: If the engine is not active (``__exit__`` without
                ``__enter__``, or twice): Python calls it only after a
                successful ``__enter__``, so this is a bug in the caller.
                Also, with nothing changed, if it is closed from another
                thread, inside backward, or under a dispatch mode or a
                ``saved_tensors_hooks`` context entered after it (R12).
        """
        if self._state is None:
            raise MmdtrError(
                'this DTR engine is not active: __exit__ was called without '
                'a matching __enter__ (or twice).',
                'Use it as `with DTR(...) as engine:`; check `engine.active` '
                'before closing it by hand.')
        if self._thread != threading.get_ident():
            raise MmdtrError(
                'this DTR engine was started on another thread; its dispatch '
                'mode and saved-tensor hooks are that thread\'s.',
                'Close it on the thread that started it.')
        _refuse_in_backward('close')
        stack = _get_current_dispatch_mode_stack()
        # a mode entered before this one and left while it was active pops
        # this one instead of its own (torch pops the top): the engine is
        # closed all the same, then the misuse reported (it was stuck
        # enabled, its hooks set; found by an adversarial search)
        popped = self._popped(stack)
        stack_top = type(stack[-1]).__name__ if stack else 'none'
        above = self._entered_above(stack)
        if above is not None:  # the body's error, if any, is its cause
            raise MmdtrError(
                f'{above} entered after this DTR engine is still active; '
                'they leave in the reverse order they entered.',
                'Leave it first, then close the engine.') from exc
        if getattr(_ACTIVE, 'engine', None) is self:
            _ACTIVE.engine = None
        state, mode, hooks = self._state, self._mode, self._hooks
        self._state = self._mode = self._hooks = None
        try:
            hooks.exit(exc_type, exc, tb)
        finally:
            try:
                if not popped:
                    mode.__exit__(exc_type, exc, tb)
                self._stats = stats_of(state)
                state.close()
            finally:
                self._collector()
        if popped and exc_type is None:  # else the body's error goes on
            raise MmdtrError(
                "this DTR engine's dispatch mode was popped by another "
                'mode\'s exit (torch pops the top mode: one entered before '
                'DTR and left while DTR was active); the engine is closed '
                f'now, and the mode on top is still entered ({stack_top}).',
                'Leave modes in the reverse order they entered: start DTR '
                'after entering the other mode and stop it before leaving '
                'that mode.')
        return False

    def _popped(self, stack) -> bool:
        """Whether this engine's mode is off the dispatch mode ``stack``
        (popped by another mode's exit)."""
        return not any(mode is self._mode for mode in stack)

    def _entered_above(self, stack) -> Optional[str]:
        """What was entered after this engine and is still active: a
        dispatch mode, or a ``saved_tensors_hooks`` context where PyTorch
        tells (2.8 and later; closing popped that context's hooks, not the
        engine's; found by an adversarial search); ``None`` if nothing
        (R12)."""
        if not self._popped(stack) and stack[-1] is not self._mode:
            return f'a dispatch mode ({type(stack[-1]).__name__})'
        hooks = self._hooks
        if hooks.entered and hooks_on_top(hooks.hooks.pack_hook) is False:
            return 'a saved_tensors_hooks context'
        return None

    @property
    def closable(self) -> bool:
        """Whether ``__exit__`` called here, on the engine's thread, would
        close it: active, and nothing entered after it still active (inside
        backward it is refused all the same)."""
        return self._state is not None and \
            self._thread == threading.get_ident() and \
            self._entered_above(_get_current_dispatch_mode_stack()) is None

    def __reduce_ex__(self, protocol):
        """Copies and pickles (``copy``, ``deepcopy``, ``pickle``) of an
        inactive engine only: an active one's state, mode and hooks belong
        to its scope (a shallow copy closed it twice)."""
        if self._state is not None:
            raise MmdtrError(
                'an active DTR engine cannot be copied or pickled: its state '
                'belongs to its scope.',
                'copy it before or after the scope, or keep engine.stats (a '
                'frozen dataclass).')
        return super().__reduce_ex__(protocol)

    @property
    def active(self) -> bool:
        """Whether the engine is entered and not yet exited."""
        return self._state is not None

    @property
    def stats(self) -> DTRStats:
        """Statistics: live while active, final after exit."""
        if self._state is not None:
            with self._state.lock:  # (R12)
                return stats_of(self._state)
        if self._stats is None:
            raise MmdtrError('this DTR engine has not run yet.',
                             'Read stats inside or after a `with` block.')
        return self._stats


_ARGUMENTS = ('eviction_threshold', 'evictee_minimum_size',
              'enable_sqrt_sampling', 'policy', 'device',
              'recording_threshold')


def _refuse_unknown_arguments(unknown: dict):
    name, value = next(iter(unknown.items()))
    close = difflib.get_close_matches(name, _ARGUMENTS, n=1)
    message = (f'DTR() got an unknown argument {name}={value!r}; accepted: '
               f'{list(_ARGUMENTS)}')
    message += f', closest match: {close[0]!r}.' if close else '.'
    hint = (f'Did you mean DTR({close[0]}=...)?'
            if close else 'See help(mmdtr.dtr.DTR).')
    raise MmdtrError(message, hint)


def _check_device(device) -> Optional[torch.device]:
    """Return ``device`` as a CPU or CUDA ``torch.device``, or ``None``."""
    if device is None:
        return None
    hint = "Use 'cpu', 'cuda', 'cuda:N', a torch.device of those, or None."
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise MmdtrError(f'device={device!r} is not a device.', hint) from None
    if parsed.type not in _DEVICE_TYPES:
        raise MmdtrError(
            f'device={device!r} is a {parsed.type!r} device; DTR meters '
            f'only {list(_DEVICE_TYPES)} memory.', hint)
    if parsed.type == 'cuda' and not torch.cuda.is_available():
        # its meter would read 0 bytes forever: nothing would be evicted
        raise MmdtrError(f'device={device!r}: CUDA is not available here.',
                         "Use device='cpu' (or None) on this machine.")
    return parsed


def _refuse_in_backward(what: str):
    """Raise inside backward (a tensor or module hook): autograd puts the
    thread's dispatch modes and saved-tensor hooks back as they were after
    each node, so an engine started or closed there would be undone (R12).
    """
    if graph_task_id() != -1:
        raise MmdtrError(
            f'a DTR engine cannot {what} inside backward (a tensor or module '
            'hook): autograd restores the thread\'s dispatch modes and '
            'saved-tensor hooks after each node, which would undo it.',
            'Start DTR before forward and stop it after backward returns '
            '(`with DTR(...)`, or mmdtr.dtr.enable() and disable()).')


def _refuse_inside_saved_tensor_hooks():
    """Raise inside another ``saved_tensors_hooks`` context (R12): the
    innermost hooks take every tensor saved, so the engine's would shadow
    them (``save_on_cpu`` would offload nothing, a compression hook
    compress nothing, ``allow_mutation_on_saved_tensors`` allow nothing)."""
    autograd = torch._C._autograd  # both on 2.4.1 and 2.13 (checked)
    if not autograd._saved_tensors_hooks_is_enabled():  # torch's error said
        # only the context's message (found by a review)
        message = autograd._saved_tensors_hooks_get_disabled_error_message()
        raise MmdtrError(
            'DTR was started inside torch.autograd.graph.'
            f'disable_saved_tensors_hooks (its message: {message or ""!r}); '
            'DTR works through saved-tensor hooks.',
            'start DTR outside that context.')
    owner = outer_saved_tensor_hooks()
    if owner is None:
        return
    raise MmdtrError(
        'DTR was started inside another saved-tensor hooks context '
        f'(its pack hook: {owner}); its hooks would take every tensor saved '
        'in scope, and the outer ones none.',
        'start DTR first and enter the other context inside it (it then '
        'handles the tensors saved in its block, DTR the rest).')


def engine_active() -> bool:
    """Whether a DTR engine is active on this thread (R12).

    Either kind counts: ``with DTR(...)`` or ``mmdtr.dtr.enable()``, and so
    does an engine's dispatch mode still on this thread's mode stack.

    Returns:
        bool: True if a new engine started here would be refused.
    """
    other = getattr(_ACTIVE, 'engine', None)
    return (other is not None and other.active) or any(
        isinstance(mode, _DTRDispatchMode)
        for mode in _get_current_dispatch_mode_stack())


def _refuse_nesting():
    """Raise if a DTR engine is already active on this thread (R12)."""
    if not engine_active():
        return
    raise MmdtrError(
        'another DTR engine is already active on this thread; engines do '
        'not nest (one per thread, started by `with DTR(...)` or '
        'mmdtr.dtr.enable()).',
        'Leave the other `with DTR(...)` block or call '
        'mmdtr.dtr.disable() first; engines in other threads are '
        'independent.')
