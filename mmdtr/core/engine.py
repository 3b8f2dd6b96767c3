"""The DTR engine's state, its records and the dispatch hot path.

One :class:`EngineState` per engine. The dispatch mode and the saved-tensor
hooks of :mod:`mmdtr.core.dtr_mode` are thin closures over it. This module
holds the state, its records and the dispatch hot path; the state's
accounting, eviction, recipe, replay, saved-tensor and in-place write
methods are grouped in the mixins of :mod:`.accounting`, :mod:`.eviction`,
:mod:`.recipes`, :mod:`.replay`, :mod:`.saved_tensors`, :mod:`.writes` and
:mod:`.foreign_memory` (and :mod:`.allocation_failures`, R15; the ops
before recording starts in :mod:`.idle_ops`, R16; the lock all engines
share, R12, in :mod:`.engine_lock`). The rules cited as R1..R16 are in
docs/design.md.
"""
import contextlib
import random

import torch

from .accounting import Accounting
from .arguments import argument_storages
from .engine_lock import ENGINE_LOCK, OPEN_ENGINES, holds, released, take_back
from .eviction import Evictor
from .foreign_memory import ForeignMemory
from .idle_ops import IdleOps
from .op_semantics import op_info, same_bits_on_replay
from .policies import keeps_evicted_classes
from .recipes import AllocNode, Recipes
from .records import _PLAIN, managed
from .replay import Replayer
from .saved_tensors import SavedTensors
from .tracked_tensors import WeakList
from .writes import Writes, bump_like_eager, versions_before, written_parts


def _run_as_is(func, args, kwargs):
    return func(*args, **kwargs)


_held = contextlib.nullcontext
_use_count = torch._C._storage_Use_Count
Tensor = torch.Tensor

_TYPE_OF_DEVICE = {}  # torch.device -> its type: ``.type`` makes a new str


def _device_type(device: torch.device) -> str:
    device_type = _TYPE_OF_DEVICE.get(device)
    if device_type is None:
        device_type = _TYPE_OF_DEVICE[device] = device.type
    return device_type


class EngineState(Accounting, Evictor, ForeignMemory, IdleOps, Recipes,
                  Replayer, SavedTensors, Writes):
    """Records, accounting and eviction of one engine (one thread, rank).

    Args:
        threshold (int | None): Evict while memory in use exceeds this;
            ``None``: only when an allocation fails (CUDA).
        min_size (int): Storages smaller than this are never evicted.
        sqrt_sampling (bool): Score about sqrt(N) sampled candidates per
            eviction instead of all N.
        policy (EvictionPolicy): Scores candidates (lower goes first).
        device (torch.device | None): The device whose memory is metered;
            ``None``: the device of the first storage an op allocates (R11).
        recording_threshold (int | None): Ops are only run and metered,
            not recorded, until memory in use passes this; ``None``:
            recorded from the first op (R16).
    """

    def __init__(self,
                 threshold,
                 min_size,
                 sqrt_sampling,
                 policy,
                 device,
                 recording_threshold=None):
        self.threshold, self.min_size = threshold, min_size
        self.sqrt_sampling, self.policy = sqrt_sampling, policy
        # DTR's evicted classes, kept only for a policy that reads e* (R8)
        self.classes = keeps_evicted_classes(policy)
        self.device = self.cuda = None
        if device is not None:
            self._meter_device(torch.device(device))
        # StorageImpl pointer (_cdata) -> StorageRecord (R2, R11)
        self.records = {}
        # StorageImpl pointer -> StorageRef: unrecorded replay outputs (R11)
        self.transients = {}
        # external StorageImpl pointer -> (WeakList of users, weakref to it)
        self.external_users = {}
        self.external_prune_at = 64  # (R10)
        # device -> AddressIndex of the non-resizable storages held by
        # recipes from outside (R14)
        self.foreign_index = {}
        self.candidates = []  # evictable records (R3)
        self.clock = 0
        self.backward_clock = -1  # clock of the latest saved-tensor unpack
        self.cut_carried = False  # a recipe being built lost an input's
        self.reach_epoch = 0  # moves when a record loses its last handle
        # saved tensors were released or unpacked since the last sweep
        self.sweep_due = False
        # records given a recipe since the last sweep; those to check at
        # the next one whatever their age
        self.unswept, self.sweep_next = WeakList(), WeakList()
        self.sweep_at = 0  # (R10)
        self.in_use = self.peak = 0
        self.evictions = self.recomputations = self.eviction_failures = 0
        # the limit in force: raised above an unreachable threshold
        self.limit = threshold
        self.remat_seconds = 0.0
        # (record, version) -> [storage, reads left]: what the outermost
        # rebuild in progress rebuilt that is read again; the (record,
        # version) pairs it rebuilt, and whether it rebuilt one twice (it
        # thrashes); None and False outside one (R4)
        self.rebuilt = self.rebuilding = None
        self.thrashing = False
        self.closed = False
        self._sampler = random.Random(0)  # never torch's RNG (R6)
        # held by every entry (an op, a save, an unpack, a free): autograd
        # may run a graph's backward in another thread (R12)
        self.lock = ENGINE_LOCK
        OPEN_ENGINES.add(self)
        self.recording_threshold = recording_threshold
        self.idle_ops = 0  # ops run before recording started (R16)
        # StorageImpl pointer -> UnrecordedTensors: the tensors ops
        # returned over a storage without a record, checked after the
        # scope as a record's are (R13, R16)
        self.unrecorded_tensors = {}
        self.unrecorded_prune_at = 64  # (R10)
        # asked before recording starts: False to wait (the façade's hooks)
        self.ready_to_record = None
        if recording_threshold:
            self.on_op = self._on_op_idle  # until memory passes it (R16)

    # the dispatch hot path (R1) -------------------------------------------
    def on_op(self, func, args, kwargs):
        # called with self.lock held (the dispatch mode takes it, R12)
        if self.sweep_due and self.clock >= self.sweep_at:
            self._sweep()  # saved tensors were released or read (R10)
        info = op_info(func)
        if info.swaps_storage:
            return self._run_set(func, args, kwargs, info)
        writes, n_declared, scratch = (), 0, ()
        if info.written_args or info.side_effect_args:
            writes, n_declared, scratch = self._writes(info, args, kwargs)
            for w in writes:
                self._before_write(w)
        rng = self._capture_rng(args, kwargs) if info.random else None
        counted = versions_before(writes) if info.versions_lists else None
        try:
            # kept while a write runs: a rebuild in a backward thread would
            # read the storage mid-write, its record still at the old
            # version (found by an adversarial search; R12)
            out = self._run(func, args, kwargs, rng, unlocked=not writes)
        except BaseException:
            self._after_failed_write(writes, info)
            raise
        self.clock += 1
        if counted is not None:
            bump_like_eager(*counted)
        new = self._register_outputs(out, args, kwargs, info)
        declared = writes[:n_declared]
        target = self._mutation_target(declared, info.full_overwrite) \
            if declared else None
        record_creator = bool(new) and torch.is_grad_enabled()
        # judged only where a recipe or creator would follow (R1): not for
        # most of backward's ops, which record no creator and write nothing
        replayable = (target is not None or record_creator) and info.replayable
        if replayable:  # by the devices it ran on, not the metered one (R4)
            devices = [_device_type(rec.device) for _, rec in new]
            if declared:
                devices += [_device_type(w.device) for w in declared]
            replayable = same_bits_on_replay(info, devices)
        node = None
        # a fresh buffer's creator is an AllocNode: no recipe to build (R5)
        if replayable and (target is not None
                           or record_creator and not info.fresh_buffer):
            node = self._make_node(func, args, kwargs, out, scratch, rng,
                                   target)
        if record_creator and replayable:
            for i, rec in new:
                if info.fresh_buffer:
                    rec.creator = AllocNode(rec.nbytes, rec.device)
                elif node is not None:  # else no recipe: kept (R4)
                    rec.creator, rec.out_index, rec.lo = node, i, 0
                    rec.cost = node.cost
                    self._link(rec, node)
                    self.unswept.add(rec)
        # a node replays one written storage (SelfRef); an op writing two
        # or more (out=(values, indices)) cannot rebuild either (R5)
        mutation = node if replayable and (len(declared) < 2 or len(
            {w.untyped_storage()._cdata
             for w in declared}) == 1) else None
        for w in declared:
            # a leaf that requires grad is written by an optimizer step: a
            # parameter, held by its module, so its later versions are never
            # rebuilt; recording each step would keep each gradient (R5).
            # _base first: a view's grad_fn, read after its base was written,
            # is rebuilt, which raises for an output of split (found by a
            # fuzzer; eager reads none under no_grad). is_leaf, not grad_fn
            # (R10): no Python object is made for the node
            self._after_write(
                w, None if w.requires_grad and w._base is None and w.is_leaf
                else mutation, info)
        for w in writes[n_declared:]:  # never replayed: caps hi (R5)
            self._after_write(w, None, info)
        memory = self.memory_after_op()
        if memory is not None:  # else not read: below the limit (R11)
            self.hold_limit(memory)
        return out

    def on_subclass_op(self, func, args, kwargs):
        """An op on tensor subclasses: run it as it is (nothing it makes is
        recorded, so it is kept), but a write to a storage the engine knows
        is seen, through a wrapper subclass to the tensors it holds too:
        readers are frozen first and no recipe replays it (R5, R7).
        """
        info = op_info(func)
        writes = given = ()
        if info.written_args or info.side_effect_args:
            given = self._writes(info, args, kwargs)[0]
            writes = [part for w in given for part in written_parts(w)]
            for w in writes:
                self._before_write(w)
        # what eager bumps: the plain tensors given, not a subclass's parts
        # (a review: bumped, they failed autograd's saved-tensor check)
        plain = [w for w in given if type(w) in _PLAIN]
        counted = versions_before(plain) if info.versions_lists else None
        try:
            # a subclass's own Python runs unlocked, but for a write (the
            # race of on_op; found by a review)
            with released(self.lock) if not writes else _held():
                out = func(*args, **kwargs)
        except BaseException:
            self._after_failed_write(writes, info)
            raise
        if counted is not None:
            bump_like_eager(*counted)
        for w in writes:
            self._after_write(w, None, info)
        return out

    def _register_outputs(self, out, args, kwargs, info, count_only=False):
        """Register the storages the call allocated; return them (R11).
        ``count_only``: count them in memory in use, with no record (R16).

        Views are detected here, at run time (R2): an output over a recorded
        storage joins that storage's record, and one over the storage of an
        input from outside is not registered.

        A storage whose only users are the output and its Python object
        (use count 2), returned by an op without alias annotations, is new:
        PyTorch's debug builds assert exactly this of non-aliasing ops.
        Anything else is checked against the inputs' storages (views such
        as ``_unsafe_view`` alias without an annotation), but for
        ``lift_fresh``'s (``torch.tensor`` of a list: made just now,
        outside the dispatcher). A sparse output's parts are counted
        (``transients``), not recorded.
        """
        if isinstance(out, Tensor):
            outs = (out, )
        elif isinstance(out, (tuple, list)):
            outs = out
        else:
            return ()
        records, new, inputs = self.records, [], None
        for i, o in enumerate(outs):
            if not isinstance(o, Tensor):
                continue
            if not managed(o):  # held: see managed()
                self.meter_held(o, args, kwargs)
                continue
            storage = o.untyped_storage()
            cdata = storage._cdata
            rec = records.get(cdata)
            if rec is not None:  # a view or write of one we know (R2)
                rec.track(o)
                continue
            transient = cdata in self.transients
            if transient:  # made idle, no record (R16)
                self.unrecorded_tensors_of(cdata, storage).track(o)  # (R13)
                if count_only:
                    continue  # counted already
            if not info.fresh_returns or _use_count(cdata) != 2:
                if inputs is None:
                    inputs = argument_storages(args, kwargs)
                if cdata in inputs and not (info.lifts_fresh
                                            and storage.resizable()):
                    # a view of an external storage (R2), checked after
                    # the scope (R13; found by a review)
                    if not transient:
                        self.unrecorded_tensors_of(cdata, storage).track(o)
                    continue
            if o.is_meta:
                continue  # nothing real (empty storages are: out= grows
                # them, R11)
            if count_only:
                self.count_unrecorded(storage, cdata, o)
                continue
            rec = self._register(storage, cdata)
            rec.track(o)
            new.append((i, rec))
        return new

    def _run(self, func, args, kwargs, rng=None, unlocked=False):
        """Run an op; on CUDA, evict and retry while it runs out of memory
        (R15).

        A random op that failed may have advanced its generator: the retry
        starts again from ``rng``, the state of its first try (R6).
        ``unlocked``: the state's lock is let go while the kernel runs (an
        op in scope; a replay keeps it, R12).
        """
        lock = self.lock
        while True:
            try:
                if not unlocked:
                    return func(*args, **kwargs)
                count = holds(lock)
                try:  # as released() does, without a generator (R1)
                    lock.release()
                    return func(*args, **kwargs)
                finally:
                    take_back(lock, count)
            except torch.cuda.OutOfMemoryError as error:  # (R15)
                if not self.cuda or not self._evict_for_allocation(error):
                    raise
                if rng is not None:
                    self._set_rng(rng)

    def stop_in_forked_child(self):
        """In a process forked while this engine was open (DataLoader
        workers: the forking thread's dispatch mode and saved-tensor hooks
        carry over), run ops and save tensors as they are, as eager does: the
        engine is the parent's. Under it a worker ran its ops through the
        engine, about ten times slower, and kept recipes of what its dataset
        cached (found by a review of long runs, R12)."""
        self.closed = True  # pack keeps saved tensors as they are
        self.on_op = self.on_subclass_op = _run_as_is

    def close(self):
        """Stop accounting; records still held by autograd stay usable."""
        with self.lock:
            self._close()

    def _close(self):
        self.closed = True
        OPEN_ENGINES.discard(self)
        # a snapshot: close_versions allocates, so a garbage collection may
        # free a storage here, and _on_free drops its record (R12)
        for rec in list(self.records.values()):
            rec.close_versions()  # later writes are unseen (R13)
        self.records = {}
        for tracked in list(self.unrecorded_tensors.values()):
            tracked.close_versions()
        self.unrecorded_tensors = {}
        self.transients = {}
        self.external_users = {}
        self.foreign_index = {}
        for rec in self.candidates:
            rec.cand_index = -1
        self.candidates = []
