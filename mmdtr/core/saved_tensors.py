"""Saved tensors: what autograd keeps instead of a managed tensor.

The saved-tensor half of :class:`~mmdtr.core.engine.EngineState` (one state
object per engine; this mixin only groups its methods): ``pack`` and
``unpack`` are the bodies of the engine's ``saved_tensors_hooks``. Rules R3
and R10 of docs/design.md.
"""
import time
import weakref

import torch

from mmdtr.errors import MmdtrError
from .records import _PLAIN, detached_alias, managed, view_meta, view_of

#: the running backward's graph task; -1 outside backward (R12; a Python
#: read of ``grad_fn._saved_self``). PyTorch 2.4 has it (its multi-grad
#: hooks and checkpoint read it)
graph_task_id = torch._C._current_graph_task_id


class AliasRef(weakref.ref):
    """A weak reference to the alias the engine made of a saved tensor.

    The alias made at the save shares the saved tensor's version counter
    (``detach()`` does). One made later over the same view, when an unpack
    hands out a rebuilt storage, has a counter of its own: ``shift`` maps it
    onto the saved tensor's (``version()``), and the ref it replaces points
    to it (``successor``), so a write through the tensor handed out is seen
    by the next unpack as eager sees it. ``dropped_version`` is the mapped
    value when the alias was dropped, at an eviction; ``None`` while it is
    alive (R10).
    """
    __slots__ = ('dropped_version', 'shift', 'successor')

    def version(self):
        """The saved tensor's counter as this alias reads it, or ``None``
        (dropped without an eviction: no handle reads it)."""
        alias = self()
        return self.dropped_version if alias is None \
            else alias._version + self.shift

    def latest(self):
        """The ref now standing for this alias's view. This ref then points
        to it: the handles that saved the view all start from the first
        ref, and each rebuild adds one to the chain (K handles walked K
        links each; found by an audit of the hot path, R1)."""
        ref = self
        while ref.successor is not None:
            ref = ref.successor
        if ref is not self:
            self.successor = ref
        return ref


def _alias_ref(alias, shift=0):
    ref = AliasRef(alias)
    ref.dropped_version, ref.shift, ref.successor = None, shift, None
    return ref


class SavedHandle:
    """What autograd keeps instead of a managed saved tensor (R10).

    Autograd refuses a saved tensor whose version counter moved since the
    save. While the saved tensor itself lives (``saved``, a weak reference)
    its counter is read and compared with ``version``, its value at the
    save, and a tensor given another storage or view since (``.data = ...``
    leaves no version behind) is refused. Afterwards, ``alias`` is the
    :class:`AliasRef` of the alias made at a save of that view (it shares
    the saved tensor's counter unless two tensors with different counters
    were saved with the same view) and ``alias_version`` its counter then.
    """
    __slots__ = ('state', 'record', 'key', 'alias', 'alias_version', 'saved',
                 'version', 'cdata')

    def __init__(self, state, record, key, alias, saved):
        self.state, self.record, self.key = state, record, key
        self.alias, self.alias_version = alias, alias.version()
        self.saved, self.version = weakref.ref(saved), saved._version
        self.cdata = record.cdata

    def __del__(self):
        with self.state.lock:  # autograd may drop it in any thread (R12)
            self.state.release(self.record)


class HeldSaved:
    """A saved tensor the engine does not manage, kept with the version
    autograd would check (hooks turn autograd's own check off).

    A plain tensor is kept as a detached alias, which shares the version
    counter: the tensor itself would close a cycle through C++ (its
    ``grad_fn`` saves it, for a saved output) that Python's garbage
    collector cannot see (R10). A subclass is kept as it is: detached below
    its ``__torch_dispatch__`` it would lose its data.
    """
    __slots__ = ('tensor', 'version')

    def __init__(self, tensor):
        self.version = tensor._version
        self.tensor = detached_alias(tensor) if type(tensor) in _PLAIN \
            else tensor


def _modified_error(shape, saved, now):
    # autograd's own words, so that code catching it sees the same error
    return RuntimeError(
        'one of the variables needed for gradient computation has been '
        f'modified by an inplace operation: a tensor of shape {shape} is at '
        f'version {now}; expected version {saved} instead (mmdtr: saved '
        'for backward under DTR).')


class SavedTensors:
    """Packs saved tensors into handles and unpacks them, rebuilding
    evicted storages; mixed into ``EngineState``."""

    def pack(self, t):
        if self.closed:
            return t
        if not managed(t):
            return HeldSaved(t)
        rec = self.records.get(t.untyped_storage()._cdata)
        if rec is None or rec.nbytes < self.min_size \
                or not rec.recomputable(rec.version):
            return HeldSaved(t)
        key = view_meta(t)
        ref = rec.alias_refs.get(key) if rec.alias_refs else None
        if ref is None or ref() is None:  # else made at an earlier save of
            alias = rec.views[key] = detached_alias(t)  # t's view: shared
            ref = _alias_ref(alias)
            if rec.alias_refs is None:
                rec.alias_refs = {}
            rec.alias_refs[key] = ref
        rec.handles += 1
        rec.last_access = self.clock
        self._add_candidate(rec)
        return SavedHandle(self, rec, key, ref, t)

    def unpack(self, handle):
        if torch.is_inference_mode_enabled():
            # backward run in inference mode: a rebuilt storage's views are
            # normal tensors, as eager's saved ones are (an inference tensor
            # has no version counter to check, R10)
            with torch.inference_mode(False):
                return self._unpack(handle)
        return self._unpack(handle)

    def _unpack(self, handle):
        self.backward_clock = self.clock
        if self.unswept and graph_task_id() != -1:
            # a backward runs: sweep what was given a recipe before it,
            # with or without handles (none is made below
            # evictee_minimum_size, so no release would ask; found by a
            # review of long runs, R10)
            self.sweep_due = True
        if isinstance(handle, HeldSaved):
            t = handle.tensor
            if t._version != handle.version:
                raise _modified_error(
                    tuple(t.shape), handle.version, t._version)
            return t
        if not isinstance(handle, SavedHandle):
            return handle
        rec = handle.record
        rec.last_access = self.clock
        handle.alias = handle.alias.latest()  # (R10)
        saved = handle.saved()
        if saved is not None:
            if saved._version != handle.version:
                # written since it was saved: what eager autograd refuses
                raise _modified_error(handle.key[1], handle.version,
                                      saved._version)
            if saved.untyped_storage()._cdata != handle.cdata \
                    or view_meta(saved) != handle.key:
                raise MmdtrError(
                    f'a tensor of shape {tuple(saved.shape)} saved for '
                    'backward was given another storage or view '
                    '(`tensor.data = ...`) before backward; eager autograd '
                    'would read the new one, DTR cannot.',
                    'Write into the tensor (copy_) instead of replacing '
                    'its .data, or do it outside the DTR scope.')
        else:
            now = handle.alias.version()
            if now is not None and now != handle.alias_version:
                raise _modified_error(handle.key[1], handle.alias_version, now)
        # writes that moved no counter of its (batch norm's statistics, an
        # alias with a counter of its own: unsafe_chunk's gates, .data):
        # eager hands it out as it is now
        version = rec.version
        t = rec.views.get(handle.key)
        if t is not None:
            return t
        storage = rec.storage()
        if storage is not None:
            t = view_of(storage, handle.key, rec.device)
            self._new_alias(rec, handle, t)
            return t
        # host time around the rebuild, for stats.remat_seconds only: the
        # engine's one timer, for reporting; no cost reads it (R9)
        start = time.perf_counter()
        storage = self.materialize(rec, version)
        t = view_of(storage, handle.key, rec.device)
        if rec.handles:
            self._new_alias(rec, handle, t)
            self._add_candidate(rec)
        self.remat_seconds += time.perf_counter() - start
        return t

    @staticmethod
    def _new_alias(rec, handle, t):
        """Make ``t``, a new tensor over a saved view, the engine's alias of
        it: its own counter, shifted onto the saved tensor's (R10)."""
        rec.views[handle.key] = t
        ref = _alias_ref(t, handle.alias_version - t._version)
        handle.alias.successor = ref  # the latest, set by unpack
        handle.alias = ref
        if rec.alias_refs is None:
            rec.alias_refs = {}
        rec.alias_refs[handle.key] = ref

    def release(self, rec):
        rec.handles -= 1
        if rec.handles == 0:
            # what reached a handle may not: the walks' reach marks go
            # stale (R1), and a sweep follows (R10)
            self.reach_epoch += 1
            self.sweep_due = True
            rec.views.clear()
            rec.alias_refs = rec.keepalive = None  # frozen: no longer (R7)
            if rec.cand_index >= 0:
                self._drop_candidate(rec)
