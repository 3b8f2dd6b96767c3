"""Saved tensors: what autograd keeps instead of a managed tensor.

The saved-tensor half of :class:`~mmdtr.core.engine.EngineState` (one state
object per engine; this mixin only groups its methods): ``pack`` and
``unpack`` are the bodies of the engine's ``saved_tensors_hooks``. Rules R3
and R10 of docs/design.md.
"""
import time

from .records import detached_alias, managed, view_meta, view_of


class SavedHandle:
    """What autograd keeps instead of a managed saved tensor (R10)."""
    __slots__ = ('state', 'record', 'key', 'version')

    def __init__(self, state, record, key, version):
        self.state, self.record, self.key = state, record, key
        self.version = version

    def __del__(self):
        self.state.release(self.record)


class SavedTensors:
    """Packs saved tensors into handles and unpacks them, rebuilding
    evicted storages; mixed into ``EngineState``."""

    def pack(self, t):
        if self.closed or not managed(t):
            return t
        rec = self.records.get(t.untyped_storage()._cdata)
        if rec is None or rec.nbytes < self.min_size \
                or not rec.recomputable(rec.version):
            return t
        key = view_meta(t)
        if key not in rec.views:
            rec.views[key] = detached_alias(t)
        rec.handles += 1
        rec.last_access = self.clock
        self._add_candidate(rec)
        return SavedHandle(self, rec, key, rec.version)

    def unpack(self, handle):
        if not isinstance(handle, SavedHandle):
            return handle
        rec = handle.record
        rec.last_access = self.clock
        if rec.version == handle.version:
            t = rec.views.get(handle.key)
            if t is not None:
                return t
            storage = rec.storage()
            if storage is not None:
                t = rec.views[handle.key] = view_of(storage, handle.key,
                                                    rec.device)
                return t
        start = time.perf_counter()
        storage = self.materialize(rec, handle.version)
        t = view_of(storage, handle.key, rec.device)
        if rec.version == handle.version and rec.handles:
            rec.views[handle.key] = t
            self._add_candidate(rec)
        self.remat_seconds += time.perf_counter() - start
        return t

    def release(self, rec):
        rec.handles -= 1
        if rec.handles == 0:
            rec.views.clear()
            if rec.cand_index >= 0:
                self._drop_candidate(rec)
