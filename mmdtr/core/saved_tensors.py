"""Saved tensors: what autograd keeps instead of a managed tensor.

The saved-tensor half of :class:`~mmdtr.core.engine.EngineState` (one state
object per engine; this mixin only groups its methods): ``pack`` and
``unpack`` are the bodies of the engine's ``saved_tensors_hooks``. Rules R3
and R10 of docs/design.md.
"""
import time
import weakref

from .overlap import views_overlap
from .records import _PLAIN, detached_alias, managed, view_meta, view_of


class SavedHandle:
    """What autograd keeps instead of a managed saved tensor (R10).

    ``alias`` is a weak reference to the engine's alias made for it, which
    shares the saved tensor's version counter, and ``alias_version`` that
    counter at the save: while the storage stays resident this is autograd's
    own check, writes after the engine's scope included.
    """
    __slots__ = ('state', 'record', 'key', 'version', 'alias', 'alias_version')

    def __init__(self, state, record, key, version, alias=None):
        self.state, self.record, self.key = state, record, key
        self.version = version
        self.alias = None if alias is None else weakref.ref(alias)
        self.alias_version = None if alias is None else alias._version

    def __del__(self):
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
        alias = None
        if key not in rec.views:  # else made from another tensor, whose
            alias = rec.views[key] = detached_alias(t)  # counter it has
        rec.handles += 1
        rec.last_access = self.clock
        self._add_candidate(rec)
        return SavedHandle(self, rec, key, rec.version, alias)

    def unpack(self, handle):
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
        alias = handle.alias() if handle.alias is not None else None
        if alias is not None and alias._version != handle.alias_version:
            raise _modified_error(handle.key[1], handle.alias_version,
                                  alias._version)
        version = handle.version
        if rec.version != version:
            if any(v > version and (meta is None or not rec.split_counters
                                    or views_overlap(meta, handle.key))
                   for v, meta in rec.saved_writes or ()):
                # written since it was saved: eager autograd refuses too
                # (a write through .data, which it allows, is refused)
                raise _modified_error(handle.key[1], version, rec.version)
            # only writes autograd does not see (side effects), or that
            # missed the saved elements through an alias with a counter of
            # its own (unsafe_chunk's gates): eager hands it out as it is
            version = rec.version
        t = rec.views.get(handle.key)
        if t is not None:
            return t
        storage = rec.storage()
        if storage is not None:
            t = rec.views[handle.key] = view_of(storage, handle.key,
                                                rec.device)
            return t
        start = time.perf_counter()
        storage = self.materialize(rec, version)
        t = view_of(storage, handle.key, rec.device)
        if rec.handles:
            rec.views[handle.key] = t
            self._add_candidate(rec)
        self.remat_seconds += time.perf_counter() - start
        return t

    def release(self, rec):
        rec.handles -= 1
        if rec.handles == 0:
            rec.views.clear()
            rec.saved_writes = None  # no handle left to check them
            if rec.cand_index >= 0:
                self._drop_candidate(rec)
