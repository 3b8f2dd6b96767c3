"""Accounting: memory in use, its peak, and the storages behind them.

The accounting half of :class:`~mmdtr.core.engine.EngineState` (one state
object per engine; this mixin only groups its methods): on CPU the
engine's own count of the storages ops allocate (R11); on CUDA the
allocator's counter (:mod:`.cuda_meter`), read every
:data:`~.cuda_meter.READ_EVERY_OPS` ops and near the limit, with that
count in between.
"""
import torch

from mmdtr.errors import MmdtrError
from .allocation_failures import watch_allocation_failures
from .arguments import SPARSE_LAYOUTS, argument_storages, held_parts
from .cuda_meter import READ_EVERY_OPS, CudaAllocatedBytes, read_guard
from .op_semantics import op_info
from .records import StorageRecord, StorageRef

_use_count = torch._C._storage_Use_Count
Tensor = torch.Tensor


def oom_eviction_needs_cuda(threshold, where: str) -> MmdtrError:
    """The error for no threshold (evict on allocation failure) off CUDA."""
    return MmdtrError(
        f'eviction_threshold={threshold!r} on {where}: no threshold (None '
        'or 0) means evicting on allocation failure, which needs CUDA.',
        "On CPU give a threshold, e.g. '2GB'.")


class Accounting:
    """Meters memory in use; mixed into ``EngineState``.

    Reads and writes the state's ``threshold``, ``limit``, ``clock``,
    ``device``, ``cuda``, ``records``, ``transients``, ``in_use`` and
    ``peak``.
    """

    def memory_in_use(self) -> int:
        """Memory in use now: on CUDA, the allocator's counter, read."""
        if self.cuda:
            return self._read_cuda()
        return self.in_use

    def memory_after_op(self):
        """Memory in use after an op, or ``None`` where it need not be read.

        On CUDA the counter is read only when the estimate, the last
        reading plus the engine's own count of storages since, could be
        within :func:`~.cuda_meter.read_guard` of the limit, or
        :data:`~.cuda_meter.READ_EVERY_OPS` ops have passed; the estimate
        counts towards the peak between reads (R11).
        """
        if not self.cuda:
            return self.in_use
        estimate, limit = self.in_use + self.cuda_offset, self.limit
        far = limit is None or estimate <= limit - self.cuda_guard
        if far and self.clock < self.cuda_read_at:
            if estimate > self.peak:
                self.peak = estimate
            return None
        return self._read_cuda()

    def _read_cuda(self) -> int:
        memory = self.cuda_meter.read()
        self.cuda_offset = memory - self.in_use
        self.cuda_read_at = self.clock + READ_EVERY_OPS
        if self.cuda_meter.peak > self.peak:
            self.peak = self.cuda_meter.peak
        return memory

    def _meter_device(self, device):
        if self.threshold is None and device.type != 'cuda':
            raise oom_eviction_needs_cuda(None, device.type)
        self.device, self.cuda = device, device.type == 'cuda'
        if self.cuda:  # memory_allocated, cheaply and rarely (R11)
            self.start_cuda_meter(CudaAllocatedBytes(device))
            watch_allocation_failures()  # the size of a failure (R15)

    def start_cuda_meter(self, meter):
        """Meter with ``meter`` (``read()`` returns bytes, ``peak`` is its
        peak), read at the next op and then as :meth:`memory_after_op`
        says."""
        self.cuda_meter = meter
        self.cuda_offset = self.cuda_read_at = 0
        self.cuda_guard = read_guard(self.threshold)

    def _register(self, storage, cdata, rec=None):
        nbytes = storage.nbytes()
        self.meter_first(nbytes, storage.device)
        if self.transients:
            transient = self.transients.pop(cdata, None)
            if transient is not None:  # a replay output adopted: counted
                self.in_use -= transient.nbytes
        if rec is None:
            rec = StorageRecord(nbytes, storage.device, self.clock)
        rec.cdata = cdata
        rec.wref = self._count(storage, cdata, nbytes, self._on_free)
        self.records[cdata] = rec
        return rec

    def recount_transient(self, storage):
        """Count ``storage`` again if it is counted without a record (made
        before recording started, R16, or by a replay) and a write resized
        it (``resize_``, ``out=``).

        Args:
            storage (UntypedStorage): The storage written.
        """
        ref = self.transients.get(storage._cdata)
        if ref is not None and storage.nbytes() != ref.nbytes:
            self.resized(ref, storage.nbytes(), storage.device)

    def resized(self, counted, nbytes, device):
        """Count ``counted`` (a record, or the reference of a storage
        counted without one) at its new size (R11).

        Args:
            counted (StorageRecord | StorageRef): What was counted, with
                its ``nbytes``.
            nbytes (int): Its size now.
            device (torch.device): Its device.
        """
        self.meter_first(nbytes, device)
        self.in_use += nbytes - counted.nbytes
        counted.nbytes = nbytes
        if self.in_use > self.peak and not self.cuda:
            self.peak = self.in_use

    def meter_first(self, nbytes, device):
        """Meter ``device`` if no device is metered yet and this storage of
        ``nbytes`` is not empty: the first storage decides (R11)."""
        if self.device is None and nbytes:
            self._meter_device(device)

    def _count(self, storage, cdata, nbytes, on_free):
        """Add ``storage`` to memory in use until ``on_free`` sees it go."""
        wref = StorageRef(storage, on_free)
        wref.cdata, wref.nbytes = cdata, nbytes
        self.in_use += nbytes
        if self.in_use > self.peak and not self.cuda:
            self.peak = self.in_use
        return wref

    def _on_free(self, wref):
        """A registered storage was freed (evicted or dropped): account.
        Any thread may free it (R12)."""
        with self.lock:
            rec = self.records.pop(wref.cdata, None)
            if rec is None or rec.wref is not wref:
                return
            self.in_use -= rec.nbytes
            rec.cdata = rec.wref = None
            if rec.cand_index >= 0:
                self._drop_candidate(rec)
            elif self.classes and rec.lo is not None \
                    and rec.has_live_users():
                # fake deletion: its users' recipes still need it, so it
                # counts in their evicted neighbourhood (R8)
                rec.join_evicted_class()

    def _meter_replay_outputs(self, func, out):
        """Count the new storages of a replayed op while they live (R11).

        Replays run below the dispatcher, so their outputs are not
        registered: the rebuilt storage until it is adopted, an older
        version rebuilt for one use, the other outputs of a multi-output op.
        """
        if not op_info(func).fresh_returns:
            return
        for o in out if isinstance(out, (tuple, list)) else (out, ):
            if not isinstance(o, Tensor):
                continue
            storage = o.untyped_storage()
            cdata = storage._cdata
            if _use_count(cdata) != 2 or cdata in self.records \
                    or cdata in self.transients:
                continue  # not a new storage of this op's own
            self._count_transient(storage, cdata)

    def _meter_rng_state(self, rng):
        """Count the generator state a random op's recipe holds for its
        replay (R6) while the recipe lives (R11): a CPU generator's is 5 KB,
        copied outside the dispatcher. On CUDA it is host memory, which
        ``memory_allocated`` does not count either."""
        if self.cuda:
            return
        storage = rng[1].untyped_storage()
        if storage._cdata not in self.transients:
            self._count_transient(storage, storage._cdata)

    def meter_held(self, t, args, kwargs):
        """Count the storages of an output the engine holds and never
        records (sparse, nested, quantized, R4) that are new: neither known
        nor those of the call's arguments (R11; :func:`.held_parts`).

        A sparse argument returned (``add_``, ``AccumulateGrad``'s ``grad
        +=``) may hold new parts now, so its own parts are not taken for
        old ones: one kept from before the scope (``mul_`` keeps the
        indices) is then counted, on the safe side (found by a review). A
        nested or quantized one returned keeps its storage.

        Args:
            t (Tensor): The output.
            args (tuple): The call's positional arguments.
            kwargs (dict): Its keyword arguments.
        """
        known = None
        for part in held_parts(t):
            storage = part.untyped_storage()
            cdata = storage._cdata
            if cdata in self.records or cdata in self.transients:
                continue
            if known is None:
                if t.layout in SPARSE_LAYOUTS:
                    args = [a for a in args if a is not t]
                    kwargs = {k: v for k, v in kwargs.items() if v is not t}
                known = argument_storages(args, kwargs, held=True)
            if cdata not in known:
                self._count_transient(storage, cdata)

    def _count_transient(self, storage, cdata):
        """Count ``storage``, which has no record, until it is freed."""
        self.transients[cdata] = self._count(storage, cdata, storage.nbytes(),
                                             self._on_transient_free)

    def _on_transient_free(self, wref):
        with self.lock:  # any thread may free it (R12)
            if self.transients.get(wref.cdata) is wref:
                del self.transients[wref.cdata]
                self.unrecorded_tensors.pop(wref.cdata, None)
                self.in_use -= wref.nbytes
