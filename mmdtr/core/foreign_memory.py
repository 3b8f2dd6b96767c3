"""Memory shared outside the dispatcher: two storages over the same bytes.

The engine tells storages apart by their ``StorageImpl`` (R2). DLPack and
NumPy make another one over the same memory, outside the dispatcher
(``torch.from_dlpack(t)``, ``torch.from_numpy(t.numpy())``): a write
through either is a write to both. Such storages wrap memory they did not
allocate, so they are not resizable. The engine keeps the address ranges
of the storages recipes may read (recorded, and held from outside) in an
index per device, and those of the non-resizable ones held by recipes in
another; a write through a non-resizable storage, or any write while one
is held, looks up the storages it overlaps (R14 of docs/design.md). This
mixin of :class:`~mmdtr.core.engine.EngineState` only groups the methods
(one state object per engine).
"""
from bisect import bisect_left, bisect_right


class AddressIndex:
    """Address ranges of live storages on one device, sorted by start.

    Args:
        disjoint (bool): Whether the ranges never overlap (storages the
            allocator made: a look-up stops at the first range that ends
            before the one asked for); else it looks back as far as the
            longest range added.
    """
    __slots__ = ('disjoint', 'starts', 'ends', 'cdatas', 'longest')

    def __init__(self, disjoint: bool):
        self.disjoint = disjoint
        self.starts, self.ends, self.cdatas = [], [], []
        self.longest = 0

    def __len__(self) -> int:
        return len(self.starts)

    def add(self, start: int, end: int, cdata: int) -> None:
        i = bisect_right(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.cdatas.insert(i, cdata)
        self.longest = max(self.longest, end - start)

    def remove(self, start: int, cdata: int) -> None:
        starts, i = self.starts, bisect_left(self.starts, start)
        while i < len(starts) and starts[i] == start:
            if self.cdatas[i] == cdata:
                del starts[i], self.ends[i], self.cdatas[i]
                return
            i += 1

    def overlapping(self, start: int, end: int) -> list:
        """Addresses of the storages whose range meets ``[start, end)``."""
        starts, ends, found = self.starts, self.ends, []
        i = bisect_left(starts, end) - 1
        lowest = start - self.longest
        while i >= 0 and starts[i] >= lowest:
            if ends[i] > start:
                found.append(self.cdatas[i])
            elif self.disjoint:
                break  # every range before ends earlier
            i -= 1
        return found


class ForeignMemory:
    """Finds the storages sharing memory with one being written; mixed into
    ``EngineState``.

    Uses the state's ``records`` and ``address_index`` / ``foreign_index``
    (device -> :class:`AddressIndex`: the storages recipes may read, the
    allocator's; the non-resizable ones held by recipes).
    """

    def _index(self, indexes, wref, storage, disjoint) -> None:
        """Add ``storage``, weakly referenced by ``wref``, to its device's
        index in ``indexes`` (zero-size storages have no range)."""
        wref.start = start = storage.data_ptr()
        end = start + storage.nbytes()
        if end == start:
            return
        index = indexes.get(wref.device)
        if index is None:
            index = indexes[wref.device] = AddressIndex(disjoint)
        index.add(start, end, wref.cdata)

    def _unindex(self, indexes, wref) -> None:
        index = indexes.get(wref.device)
        if index is not None:
            index.remove(wref.start, wref.cdata)
            if not index:
                del indexes[wref.device]

    def _index_held(self, wref, storage) -> None:
        """A recipe holds ``storage`` from outside (R14)."""
        wref.device = storage.device
        if storage.resizable():
            self._index(self.address_index, wref, storage, True)
        else:
            self._index(self.foreign_index, wref, storage, False)

    def _unindex_held(self, wref) -> None:
        self._unindex(self.address_index, wref)
        self._unindex(self.foreign_index, wref)

    def _sharing_memory(self, storage, cdata) -> list:
        """Addresses of the other storages recipes may read that share
        memory with ``storage``: recorded or held ones when it is not
        resizable (a DLPack or NumPy alias), and non-resizable ones held
        by recipes (R14)."""
        foreign = self.foreign_index
        alias = cdata not in self.records and not storage.resizable()
        if not (alias or foreign):
            return []
        start = storage.data_ptr()
        end = start + storage.nbytes()
        if end == start:
            return []
        device, found = storage.device, []
        if alias and device in self.address_index:
            found += self.address_index[device].overlapping(start, end)
        if device in foreign:
            found += foreign[device].overlapping(start, end)
        return [other for other in found if other != cdata]
