"""The outputs a selective policy kept, and the writes to them (torch
only).

SAC's store holds each kept output with its version, and PyTorch refuses
in backward one written since. Writes through an alias with a version
counter of its own (``_unsafe_view``, ``unsafe_chunk``) leave that version
unmoved: :class:`KeptOutputs` sees them, in the forward and after it, and
:func:`written_kept_output` names the op whose kept output was written.
A write in the forward to a kept output it can copy first is let through:
the store gets the copy (:meth:`KeptOutputs.saw_write`).
"""
import weakref
from contextlib import contextmanager
from typing import Optional

import torch
from torch.utils._python_dispatch import (TorchDispatchMode,
                                          _get_current_dispatch_mode,
                                          _pop_mode_temporarily)
from torch.utils._pytree import tree_leaves

from mmdtr.core.arguments import tensors_in
from mmdtr.core.op_semantics import get_arg, op_info


class _WriteWatch(TorchDispatchMode):
    """Private and nearly empty: hands each op that writes an argument in
    place to :meth:`KeptOutputs.saw_write`, and each op's outputs to
    :meth:`KeptOutputs.saw_outputs`."""

    def __init__(self, kept: 'KeptOutputs'):
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = op_info(func)
        if info.written_args and self.kept.written_op is None:
            self.kept.saw_write(
                tensors_in(
                    get_arg(info, args, kwargs, i) for i in info.written_args))
        out = func(*args, **kwargs)
        self.kept.saw_outputs(out)
        return out


class KeptOutputs:
    """The outputs a selective policy kept in one checkpointed call, and
    the writes to them.

    SAC's store holds each kept output with its version. But a batched
    matmul's output comes back through ``_unsafe_view``, and a GRU cell
    splits its gates with ``unsafe_chunk``: aliases whose version counters
    are their own. A write through one left the kept output's counter
    unmoved, and the recompute read the written value and wrote it again:
    other gradients, silently (found by a review). So during the forward,
    every op writing in place is checked against the kept storages, and
    after it every tensor the forward made that is still alive and over a
    kept storage (returned, or kept by the module: ``self.scores``) is
    watched by its own counter (a write after the module returned).

    Args:
        sac_forward: The forward context of
            :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`.
    """

    def __init__(self, sac_forward):
        self.sac_forward = sac_forward
        self.written_op: Optional[str] = None  # seen in the forward
        self.made: list = []  # weak references to the forward's outputs
        self.outputs: list = []  # (detached alias, version, op)

    @contextmanager
    def forward(self):
        """SAC's forward context, with the writes watched."""
        with self.sac_forward, _WriteWatch(self):
            yield

    def saw_write(self, written: list) -> None:
        """An op of the forward is about to write ``written`` in place.

        A kept output it writes is copied first, and the store given the
        copy, which the recompute reads: the output of a Conv-BN fused by
        ``efficient_conv_bn_eval`` is a convolution's, and the
        ``ReLU(inplace=True)`` after it was refused (found by an
        adversarial search; the copy weighs what the BatchNorm's output
        did unfused). Where it cannot be copied so (a kept view, another
        kept output over the same storage, a copy with other strides,
        another mode between this one and SAC's), the op is noted as
        written.
        """
        storages = {_storage_id(t) for t in written} - {None}
        written_entries = [(key, entry) for key, entry in self._entries()
                           if _storage_id(entry.val) in storages]
        if written_entries and not self._copied_before_write(written_entries):
            self.written_op = _op_name(written_entries[0][0])

    def _copied_before_write(self, written_entries: list) -> bool:
        """Give each ``(op, entry)`` of ``written_entries`` a copy of its
        value; False, with nothing changed, where that could not be done
        exactly."""
        if not all(_returns_fresh_tensors(op) for op, _ in written_entries):
            # a kept view (a policy keeping view ops) would no longer alias
            # its base in the recompute (found by a review)
            return False
        storage_ids = [_storage_id(entry.val) for _, entry in written_entries]
        if len(set(storage_ids)) < len(storage_ids):
            return False  # kept outputs alias each other (defensive: fresh
            # returns have storages of their own); copies would not
        # inside this mode's __torch_dispatch__, SAC's is next: the copy
        # runs below it (not an op of the forward), metered by any mode
        # below (DTR's)
        if _get_current_dispatch_mode() is not self.sac_forward:
            return False
        with _pop_mode_temporarily():
            copies = [entry.val.clone() for _, entry in written_entries]
        if any(c.stride() != entry.val.stride()
               for c, (_, entry) in zip(copies, written_entries)):
            return False
        for copy, (_, entry) in zip(copies, written_entries):
            entry.val, entry.version = copy, copy._version
        return True

    def saw_outputs(self, out) -> None:
        """An op of the forward returned ``out``: remember its tensors
        weakly, for :meth:`watch_outputs`."""
        if isinstance(out, torch.Tensor):
            self.made.append(weakref.ref(out))
        elif isinstance(out, (tuple, list)):
            self.made += [
                weakref.ref(t) for t in out if isinstance(t, torch.Tensor)
            ]

    def watch_outputs(self, out) -> None:
        """At the end of the forward: watch the tensors it made that are
        still alive and over a kept storage, and the module's outputs, by
        their own version counters (held detached: the counter, not the
        graph; SAC keeps the storage anyway)."""
        kept = {
            entry.val.untyped_storage()._cdata: key
            for key, entry in self._entries()
        }
        alive = [t for t in (ref() for ref in self.made) if t is not None]
        self.made = []
        if not kept:
            return
        with torch._C._DisableTorchDispatch():
            for t in alive + tree_leaves(out):
                key = kept.get(_storage_id(t))
                if key is not None:
                    self.outputs.append((t.detach(), t._version, key))

    def release_outputs(self) -> None:
        """Let the watched outputs go: at the recompute, after the last
        check (SAC lets the kept outputs go as the recompute takes them)."""
        self.outputs = []

    def _entries(self):
        """``(op, entry)`` of each tensor output in SAC's store, an entry
        holding ``val`` and its ``version``; none where the store has
        another shape (another torch): backward then raises PyTorch's own
        error."""
        store = getattr(self.sac_forward, 'storage', None)
        if not isinstance(store, dict):
            return
        for key, entries in store.items():
            if isinstance(entries, dict):  # by call index (newer torch)
                entries = list(entries.values())
            for entry in tree_leaves(entries):
                val = getattr(entry, 'val', None)
                version = getattr(entry, 'version', None)
                if isinstance(val, torch.Tensor) and version is not None:
                    yield key, entry

    def written(self) -> Optional[str]:
        """The op whose kept output was written in place since it was
        kept, or None."""
        if self.written_op is not None:
            return self.written_op
        for key, entry in self._entries():
            if entry.val._version != entry.version:
                return _op_name(key)
        for alias, version, key in self.outputs:
            if alias._version != version:
                return _op_name(key)
        return None


def _storage_id(t) -> Optional[int]:
    """The StorageImpl pointer of a strided tensor with a storage, or None
    (a wrapper subclass has none)."""
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


#: Ops whose returns alias an input with no alias annotation.
_UNANNOTATED_VIEWS = frozenset(('_unsafe_view', 'unsafe_chunk', 'unsafe_split',
                                'unsafe_split_with_sizes'))


def _op_of(key):
    """The op of a key of SAC's store (the op, or a tuple starting with
    it)."""
    return key[0] if isinstance(key, tuple) else key


def _returns_fresh_tensors(key) -> bool:
    """Whether the op of a store key returns tensors over storages of their
    own (no view of an input); False when unsure."""
    schema = getattr(_op_of(key), '_schema', None)
    if schema is None:
        return False
    return all(r.alias_info is None for r in schema.returns) and \
        schema.name.split('::')[-1] not in _UNANNOTATED_VIEWS


def _op_name(key) -> str:
    return str(_op_of(key))


def written_kept_output(kept_outputs: list) -> Optional[str]:
    """The op whose output a selective policy kept and a later op wrote in
    place, if any: PyTorch's selective checkpointing raises on it in
    backward, or, through an unsafe alias, reads the written value.

    Args:
        kept_outputs (list[KeptOutputs]): The checkpointed calls' kept
            outputs to look through.

    Returns:
        str | None: The op (the key of SAC's store entry), or None.
    """
    for kept in kept_outputs:
        op = kept.written()
        if op is not None:
            return op
    return None
