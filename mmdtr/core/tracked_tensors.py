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

    def prune(self, unwanted=None) -> None:
        """Drop the references to dead objects, and to those for which
        ``unwanted(obj)`` is true if it is given."""
        if unwanted is None:
            self[:] = [ref for ref in self if ref() is not None]
        else:
            self[:] = [
                ref for ref in self
                if (obj := ref()) is not None and not unwanted(obj)
            ]
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


class TrackedTensors:
    """Tracks tensors over one storage; a mixin for classes with the slots
    ``tensors`` (``WeakList | None``), ``exit_versions`` (``tuple | None``)
    and ``cdata`` (the storage's StorageImpl pointer)."""
    __slots__ = ()

    def track(self, tensor) -> None:
        """Remember a tensor an op returned over this storage (R13)."""
        if self.tensors is None:
            self.tensors = WeakList()
        elif self.tensors[-1]() is tensor:
            return  # an in-place op returns its input
        self.tensors.add(tensor)

    def close_versions(self) -> None:
        """At the end of the scope: note the version counter of each
        tracked tensor still alive (R13)."""
        if self.tensors is not None:
            self.exit_versions = tuple(
                (weakref.ref(t), t._version) for t in self.tensors.live()
                if not t.is_inference())  # no counter to read
            self.tensors = None

    def written_after_close(self):
        """``(tensor, version at the close)`` of a tracked tensor still
        over this storage whose counter moved since the scope closed, or
        ``None`` (R13)."""
        for ref, version in self.exit_versions or ():
            t = ref()
            if t is not None and t._version != version and \
                    t.untyped_storage()._cdata == self.cdata:
                return t, version
        return None


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
    __slots__ = ('tensors', 'exit_versions', 'cdata', 'storage')

    def __init__(self, cdata: int, storage=None):
        self.cdata, self.storage = cdata, storage
        self.tensors = self.exit_versions = None

    def stale(self) -> bool:
        """Whether its storage from outside was freed."""
        return self.storage is not None and self.storage() is None
