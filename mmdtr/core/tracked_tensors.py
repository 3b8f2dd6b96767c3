"""The tensors ops in scope returned over a storage, and their version
counters when the scope closed (rule R13 of docs/design.md).

Once the scope has closed the dispatcher shows the engine nothing, but a
backward run after it may still replay recipes that read a storage as it
is. A write after the close through any tensor an op returned in scope is
seen by comparing its counter with the one noted at the close: some of
those tensors (``_unsafe_view``, ``unsafe_split``, ``.data``) have a
counter of their own, so the tensor a recipe read is not enough.
:class:`TrackedTensors` is the mechanism, for a record
(:class:`~mmdtr.core.records.StorageRecord`) and for a storage without one
(:class:`UnrecordedTensors`: made before the scope, or before recording
started, R16).
"""
import weakref


class WeakList(list):
    """Weak references to objects: the records whose recipes read one
    record, the tensors ops returned over its storage.

    Lighter than a ``weakref.WeakSet`` (one list and one reference per
    object, no callbacks), which matters on the hot path (R1): dead
    references are dropped when the list has doubled since the last pruning,
    so adding stays O(1) amortized and a record read every iteration of a
    long scope does not grow it without bound.
    """
    __slots__ = ('prune_at', )

    def __init__(self):
        super().__init__()
        self.prune_at = 8

    def add(self, obj) -> None:
        if len(self) >= self.prune_at:
            self.prune()
        self.append(weakref.ref(obj))

    #: Whether an object added again is kept once when the list is pruned
    #: (a list of readers keeps one entry per read, R4).
    unique = False

    def prune(self, unwanted=None) -> None:
        """Drop the references to dead objects, to objects for which
        ``unwanted(obj)`` is true if it is given, and, in a :attr:`unique`
        list, repeated ones."""
        kept, seen = [], set()
        for ref in self:
            obj = ref()
            if obj is None or unwanted is not None and unwanted(obj):
                continue
            if self.unique:
                if id(obj) in seen:
                    continue
                seen.add(id(obj))
            kept.append(ref)
        self[:] = kept
        self.prune_at = max(8, 2 * len(self))

    def live(self) -> list:
        """The objects still alive, each once. References to dead ones are
        dropped: a list that stopped growing is not walked whole again at
        each read (the users of a storage read by many ops, read at each
        of its evictions; found by an audit of the hot path, R1)."""
        if len(self) == 1:
            obj = self[0]()
            return [] if obj is None else [obj]
        objs, seen, dead = [], set(), 0
        for ref in self:
            obj = ref()
            if obj is None:
                dead += 1
            elif id(obj) not in seen:
                seen.add(id(obj))
                objs.append(obj)
        if dead:
            self.prune()
        return objs

    def any_live(self) -> bool:
        """Whether an object is alive; the dead ones before the first live
        one are dropped, so the next call does not walk them again."""
        for i, ref in enumerate(self):
            if ref() is not None:
                if i:
                    del self[:i]
                return True
        return False


class TensorRefs(WeakList):
    """Weak references to the tensors ops returned over one storage, each
    kept once: a parameter written in place each iteration of a long scope
    is returned again and again, between views of it that are not, and its
    list grew by one reference per iteration (found by an adversarial
    search, R10)."""
    __slots__ = ()
    unique = True


def _moved(versions, cdata):
    """``(tensor, version noted)`` of the first of ``versions`` (pairs of
    a weak reference and a version) alive, still over storage ``cdata``,
    whose counter moved since; else ``None``."""
    for ref, version in versions or ():
        t = ref()
        if t is not None and t._version != version and \
                t.untyped_storage()._cdata == cdata:
            return t, version
    return None


def stays_on(t, cdata) -> bool:
    """Whether ``t`` is gone or not a view of a base off ``cdata`` (whose
    writes move ``t``'s counter)."""
    return t is None or t._base is None or \
        t._base.untyped_storage()._cdata == cdata


class TrackedTensors:
    """Tracks tensors over one storage; a mixin for classes with the slots
    ``tensors`` (``TensorRefs | None``), ``exit_versions`` (``tuple | None``),
    ``synced`` (``tuple | None``) and ``cdata`` (the storage's StorageImpl
    pointer)."""
    __slots__ = ()

    def track(self, tensor) -> None:
        """Remember a tensor an op returned over this storage (R13)."""
        if self.tensors is None:
            self.tensors = TensorRefs()
        elif self.tensors[-1]() is tensor:
            return  # an in-place op returns its input
        self.tensors.add(tensor)

    def _versions(self) -> tuple:
        """``(weak reference, version)`` of each tracked tensor alive."""
        return tuple((weakref.ref(t), t._version) for t in self.tensors.live()
                     if not t.is_inference())  # no counter to read

    def close_versions(self) -> None:
        """At the end of the scope: note the version counter of each
        tracked tensor still alive (R13)."""
        if self.tensors is not None:
            self.exit_versions = self._versions()
            self.tensors = None
        self.synced = None

    def sync(self) -> None:
        """In scope, before a recipe reads the storage as it is: note the
        tracked tensors' counters, unless noted since the last write the
        engine saw (R13; :meth:`unsync` forgets them at each)."""
        if self.synced is None and self.tensors is not None:
            self.synced = self._versions()

    def unsync(self) -> None:
        """The engine saw a write to the storage: the counters moved."""
        self.synced = None

    def written_unseen(self):
        """``(tensor, version noted)`` of a tracked tensor still over this
        storage whose counter moved although the engine saw no write: since
        the scope closed, or, in scope, since :meth:`sync` (another thread
        wrote it); else ``None`` (R13). In scope a view whose base moved to
        another storage (``.data =``, ``set_``) is not counted: it shares
        its counter with writes there, which the engine sees (found by a
        review)."""
        if self.exit_versions:
            return _moved(self.exit_versions, self.cdata)
        return _moved([(ref, version) for ref, version in self.synced or ()
                       if stays_on(ref(), self.cdata)], self.cdata)


class UnrecordedTensors(TrackedTensors):
    """The tensors ops in scope returned over a storage without a record
    (made before the scope, or by an op run before recording started,
    R16), and for the latter the tensor that made it: a recipe reads such a
    storage as it is (R13).

    Args:
        cdata (int): The storage's StorageImpl pointer.
        storage (weakref.ref, optional): For a storage from outside the
            scope, a weak reference to it: the entry is stale once it is
            dead (its pointer may be reused). ``None`` for one made in
            scope, whose entry goes when it is freed.
    """
    __slots__ = ('tensors', 'exit_versions', 'synced', 'cdata', 'storage')

    def __init__(self, cdata: int, storage=None):
        self.cdata, self.storage = cdata, storage
        self.tensors = self.exit_versions = self.synced = None

    def stale(self) -> bool:
        """Whether its storage from outside was freed."""
        return self.storage is not None and self.storage() is None
