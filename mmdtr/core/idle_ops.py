"""Ops run before recording starts (rule R16 of docs/design.md).

With a ``recording_threshold`` an engine first runs ops as they are and
meters what they allocate, recording nothing; once memory in use passes the
threshold, the ops that follow are recorded. :class:`IdleOps` is the
state's half of it (a mixin of :class:`~mmdtr.core.engine.EngineState`),
:class:`DeferredHooks` the façade's: where PyTorch tells whether another
saved-tensor hooks context is active (2.8 and later), the engine's hooks are
pushed when recording starts, so that autograd saves the idle ops' tensors
itself, with its own version check, and calls no Python per saved tensor.
"""
import weakref
from typing import Optional

import torch

from mmdtr.errors import MmdtrError
from .arguments import tensors_in
from .op_semantics import get_arg, op_info
from .records import _PLAIN
from .saved_tensors import graph_task_id
from .sizes import parse_size
from .torch_compat import can_read_saved_tensor_hooks, outer_saved_tensor_hooks
from .writes import bump_like_eager, storage_set_made, versions_before

_autograd = torch._C._autograd


def check_recording_threshold(value, eviction_threshold) -> Optional[int]:
    """Check a ``recording_threshold`` against the eviction threshold: what
    runs before recording starts is never evicted, so at or above it
    nothing recorded could bring memory back under the threshold (R16).

    Args:
        value (int | str | None): As given to ``DTR``.
        eviction_threshold (int | None): The eviction threshold in bytes.

    Returns:
        int | None: The recording threshold in bytes; ``None`` for none
        (``None`` or 0: record from the first op).

    Raises:
        MmdtrError: If ``value`` is not a size, or not below the eviction
            threshold.
    """
    if isinstance(value, str) and value == 'auto':  # as the dtr key reads it
        raise MmdtrError(
            f'recording_threshold={value!r} is not a size: DTR takes bytes '
            "or None. 'auto' is read by the dtr config key and DTRHook, "
            'which choose a size per iteration from the recent ones.',
            'Give a size, or None to record from the first op; in a loop '
            'of your own, RecentSteps (mmdtr.core.recording_threshold) '
            "gives the size 'auto' would choose.")
    recording = parse_size(value, 'recording_threshold', allow_none=True)
    if not recording:
        return None
    if eviction_threshold is not None and recording >= eviction_threshold:
        raise MmdtrError(
            f'recording_threshold={value!r} ({recording} bytes) is not below '
            f'eviction_threshold ({eviction_threshold} bytes): what ops '
            'allocate before recording starts is never evicted.',
            'Give a smaller recording_threshold (half the eviction '
            'threshold, say), or None to record from the first op.')
    return recording


class IdleOps:
    """Runs and meters ops until recording starts; mixed into
    ``EngineState``, whose ``__init__`` points ``on_op`` at
    :meth:`_on_op_idle` while a ``recording_threshold`` is pending.

    Reads and writes the state's ``recording_threshold``,
    ``ready_to_record``, ``idle_ops``, ``clock``, ``transients``,
    ``limit``, ``threshold``, ``in_use`` and ``cuda_offset``.
    """

    def _on_op_idle(self, func, args, kwargs):
        """An op before recording starts (R16): run as it is, as eager
        runs it, with its new storages metered (as ``on_op`` meters them)
        and none recorded: like storages from before the scope, they are
        never evicted. Once memory in use passes ``recording_threshold``,
        and ``ready_to_record()`` (if set) agrees, the ops that follow are
        recorded."""
        info = op_info(func)
        writes = info.written_args or info.side_effect_args
        # a _foreach_ op's kernels bump no counter below the mode: eager's
        # saved-tensor check must see its writes (R10; found by a review)
        counted = versions_before(self._writes(
            info, args, kwargs)[0]) if info.versions_lists else None
        out = self._run(func, args, kwargs, unlocked=not writes)
        self.clock += 1
        self.idle_ops += 1
        if counted is not None:
            bump_like_eager(*counted)
        if info.written_args:  # resize_, out= into a smaller tensor (R11)
            for w in tensors_in(
                    get_arg(info, args, kwargs, i) for i in info.written_args):
                if type(w) in _PLAIN:  # a wrapper subclass has no storage
                    self.recount_transient(w.untyped_storage())
        if info.swaps_storage:
            storage = storage_set_made(info, args, kwargs)
            if storage is not None and storage._cdata not in self.transients:
                self.count_unrecorded(storage, storage._cdata)  # grows later
        self._register_outputs(out, args, kwargs, info, count_only=True)
        memory = self.memory_after_op()
        if memory is None:  # CUDA between reads, far below the limit: the
            memory = self.in_use + self.cuda_offset  # estimate (R11)
        else:
            # with nothing evictable yet, memory above the limit counts a
            # failure and raises it (R11), so a threshold not held is
            # reported (found by a review: a scope whose hooks could not
            # be pushed in time)
            self.hold_limit(memory)
        if memory > self.recording_threshold and (self.ready_to_record is None
                                                  or self.ready_to_record()):
            del self.on_op  # the class's: every later op recorded (R16)
        return out

    def count_unrecorded(self, storage, cdata, maker=None):
        """Count a new storage that gets no record (an op run before
        recording starts) until it is freed.

        Args:
            storage (UntypedStorage): The storage.
            cdata (int): Its StorageImpl pointer.
            maker (Tensor, optional): The tensor the op returned over it,
                checked after the scope if a recipe reads the storage
                (R13).
        """
        self.meter_first(storage.nbytes(), storage.device)
        self._count_transient(storage, cdata)
        if maker is not None:
            self.transients[cdata].maker = weakref.ref(maker)


class DeferredHooks:
    """The engine's ``saved_tensors_hooks`` context, entered at once or
    when recording starts (R16).

    Deferred only with a recording threshold and where PyTorch tells
    whether another hooks context is active (2.8 and later). They are then
    pushed at the first op past the threshold that runs outside backward
    (autograd puts the hooks back as they were after each node, R12), with
    saved-tensor hooks enabled and no other context on the stack: pushed
    above one, they would be popped by its exit. Until then recording
    waits, op by op.

    Args:
        hooks (saved_tensors_hooks): The engine's context, not entered.
        defer (bool): Whether to wait for recording to start.
    """

    def __init__(self, hooks, defer: bool):
        self.hooks, self.entered = hooks, False
        self.deferred = defer and can_read_saved_tensor_hooks()

    def enter(self):
        """Push the hooks now, unless they wait for recording."""
        if not self.deferred:
            self._enter()

    def _enter(self):
        self.hooks.__enter__()
        self.entered = True

    def enter_if_clear(self) -> bool:
        """Push the hooks if nothing stands in the way; whether they are
        on (recording may start)."""
        if self.entered:
            return True
        if graph_task_id() != -1 or \
                not _autograd._saved_tensors_hooks_is_enabled() or \
                outer_saved_tensor_hooks() is not None:
            return False
        self._enter()
        return True

    def exit(self, exc_type=None, exc=None, tb=None):
        """Pop the hooks if they were pushed."""
        if self.entered:
            self.entered = False
            self.hooks.__exit__(exc_type, exc, tb)
