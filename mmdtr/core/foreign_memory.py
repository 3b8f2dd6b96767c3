"""Memory shared outside the dispatcher: two storages over the same bytes.

The engine tells storages apart by their ``StorageImpl`` (R2). DLPack and
NumPy make another one over the same memory, outside the dispatcher
(``torch.from_dlpack(t)``, ``torch.from_numpy(t.numpy())``): a write
through either is a write to both. Such storages wrap memory they did not
allocate, so they are not resizable. A write through one the engine did not
record walks the storages recipes may read for those it overlaps, at their
addresses then; the non-resizable storages recipes hold are kept in an
index by address, looked up at every write while there are any (R14 of
docs/design.md). This mixin of :class:`~mmdtr.core.engine.EngineState`
only groups the methods (one state object per engine).
"""
from bisect import bisect_left, bisect_right


class AddressIndex:
    """Address ranges of live storages on one device, sorted by start.

    Ranges may overlap (two aliases of one array): a look-up looks back as
    far as the longest range added.
    """
    __slots__ = ('starts', 'ends', 'cdatas', 'longest')

    def __init__(self):
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
        """StorageImpl pointers (``_cdata``) of the storages whose data
        address range meets ``[start, end)``."""
        starts, ends, found = self.starts, self.ends, []
        i = bisect_left(starts, end) - 1
        lowest = start - self.longest
        while i >= 0 and starts[i] >= lowest:
            if ends[i] > start:
                found.append(self.cdatas[i])
            i -= 1
        return found


def _meets(storage, start: int, end: int, device) -> bool:
    """Whether live ``storage`` has memory in ``[start, end)`` on
    ``device``."""
    if storage is None or storage.device != device:
        return False
    other = storage.data_ptr()
    return other < end and start < other + storage.nbytes()


class ForeignMemory:
    """Finds the storages sharing memory with one being written; mixed into
    ``EngineState``.

    Uses the state's ``records``, ``external_users`` and ``foreign_index``
    (device -> :class:`AddressIndex` of the non-resizable storages held by
    recipes).
    """

    def _index_held(self, wref, storage) -> None:
        """A recipe holds ``storage`` from outside: indexed if it is not
        resizable (its memory cannot move then, R14)."""
        if storage.resizable():
            return
        wref.device, wref.start = storage.device, storage.data_ptr()
        end = wref.start + storage.nbytes()
        if end != wref.start:
            index = self.foreign_index.get(wref.device)
            if index is None:
                index = self.foreign_index[wref.device] = AddressIndex()
            index.add(wref.start, end, wref.cdata)

    def _unindex_held(self, wref) -> None:
        index = self.foreign_index.get(getattr(wref, 'device', None))
        if index is not None:
            index.remove(wref.start, wref.cdata)
            if not index:
                del self.foreign_index[wref.device]

    def _sharing_memory(self, storage, cdata) -> list:
        """StorageImpl pointers (``_cdata``) of the other storages recipes
        may read that share memory with ``storage``: when it is not
        resizable and not recorded (a DLPack or NumPy alias), every one met
        at its data address now (a walk: such writes are rare); and, while
        recipes hold non-resizable storages, those of them it meets
        (R14)."""
        foreign = self.foreign_index
        alias = cdata not in self.records and not storage.resizable()
        if not (alias or foreign):
            return []
        start = storage.data_ptr()
        end = start + storage.nbytes()
        if end == start:
            return []
        device, found = storage.device, {}
        if alias:  # snapshots: a finalizer may change the tables meanwhile
            for rec in list(self.records.values()):
                if _meets(rec.storage(), start, end, device):
                    found[rec.cdata] = None
            for other, (_, ref) in list(self.external_users.items()):
                if _meets(ref(), start, end, device):
                    found[other] = None
        if device in foreign:
            found.update(
                dict.fromkeys(foreign[device].overlapping(start, end)))
        found.pop(cdata, None)
        return list(found)
