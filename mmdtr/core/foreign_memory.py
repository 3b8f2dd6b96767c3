"""Memory shared outside the dispatcher: two storages over the same bytes.

The engine tells storages apart by their ``StorageImpl`` (R2). DLPack and
NumPy make another one over the same memory, outside the dispatcher
(``torch.from_dlpack(t)``, ``torch.from_numpy(t.numpy())``): a write
through either is a write to both. Such storages wrap memory they did not
allocate, so they cannot be resized: a storage that is not resizable is
compared once, by address range, with every storage the engine knows, and
the pairs that overlap are kept (R14 of docs/design.md). This mixin of
:class:`~mmdtr.core.engine.EngineState` only groups the methods (one state
object per engine).
"""
from .records import StorageRef


class ForeignMemory:
    """Pairs storages that share memory; mixed into ``EngineState``.

    Uses the state's ``records``, ``external_users``, ``lock``,
    ``foreign`` (address of a non-resizable storage compared once -> its
    :class:`StorageRef`) and ``shared_with`` (address -> addresses of the
    storages sharing its memory, both ways).
    """

    def _note_if_foreign(self, storage) -> None:
        """Compare a storage that is not resizable with those known, once
        (R14). Called for storages the engine did not record, when a recipe
        first holds one and before one is written."""
        cdata = storage._cdata
        if cdata in self.foreign or storage.resizable():
            return
        ref = StorageRef(storage, self._forget_foreign)
        ref.cdata, ref.nbytes = cdata, 0
        self.foreign[cdata] = ref
        start = storage.data_ptr()
        end, device = start + storage.nbytes(), storage.device
        if end == start:
            return
        for other in self._known_storages():
            if other is None or other._cdata == cdata \
                    or other.device != device:
                continue
            other_start = other.data_ptr()
            if other_start < end and start < other_start + other.nbytes():
                self.shared_with.setdefault(cdata, []).append(other._cdata)
                self.shared_with.setdefault(other._cdata, []).append(cdata)

    def _known_storages(self):
        """The live storages the engine knows: recorded, held by recipes,
        and compared before."""
        for rec in self.records.values():
            yield rec.storage()
        for _, ref in self.external_users.values():
            yield ref()
        for ref in self.foreign.values():
            yield ref()

    def _forget_foreign(self, ref) -> None:
        with self.lock:  # any thread may free it (R12)
            if self.foreign.get(ref.cdata) is not ref:
                return
            del self.foreign[ref.cdata]
            for other in self.shared_with.pop(ref.cdata, ()):
                peers = self.shared_with.get(other)
                if peers is not None and ref.cdata in peers:
                    peers.remove(ref.cdata)
                    if not peers:
                        del self.shared_with[other]

    def _after_shared_write(self, cdata) -> None:
        """A write to storage ``cdata`` changed the records sharing its
        memory too: their new versions cannot be rebuilt (R5, R14)."""
        for other in self.shared_with.get(cdata, ()):
            rec = self.records.get(other)
            if rec is not None:
                rec.version += 1
                self._cap_hi(rec)
