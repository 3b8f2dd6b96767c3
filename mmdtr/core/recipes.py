"""Recipes: how an op's call is recorded so that it can be replayed.

An :class:`OpNode` is one recorded call with its tensor arguments replaced
by references (:mod:`~mmdtr.core.recipe_refs`) that say how to get each
input back at the version that call read (rule R4 of
docs/design.md). :class:`Recipes` is the recipe half of
:class:`~mmdtr.core.engine.EngineState` (one state object per engine; the
mixin only groups its methods): it builds the nodes and links the records
both ways to the records their recipes read (R8, R10).
"""
import weakref

import torch

from . import backend_flags
from .cost_model import op_cost
from .op_semantics import op_info
from .recipe_refs import HeldRef, RecordRef, ScratchRef, SelfRef
from .records import (StorageRef, counter_sharing_alias, detached_alias,
                      managed, view_meta)
from .tracked_tensors import UnrecordedTensors, WeakList

Tensor = torch.Tensor
_STRIDED = torch.strided


def _is_leaf(t) -> bool:
    """Whether ``t`` is a leaf (its ``grad_fn`` is None); False for an
    output of a multi-output view op (``split``) whose base was written
    since: autograd refuses to rebuild its grad_fn, which eager never asks
    for in an op that does not differentiate (``v > 0``; found by a fuzzer).

    Read as ``is_leaf``, not ``grad_fn``, which makes a Python object for
    the node: one made lives as long as the node and keeps PyTorch from
    freeing a long graph without recursion (R10)."""
    try:
        return t.is_leaf
    except RuntimeError:
        return False


_REFS = (RecordRef, HeldRef, SelfRef, ScratchRef)


class OpNode:
    """One recorded call: ``func(*args, **kwargs)`` with references.

    Args:
        func: The ``OpOverload``.
        args (tuple): Arguments, tensors replaced by references (one level
            of lists/tuples is searched, as aten ops take tensor lists).
        kwargs (dict): Keyword arguments, likewise.
        cost (float): Cost of the call in FLOP-equivalents.
        rng (tuple | None): ``(generator, state)`` of a random op.

    Attributes:
        default_dtype (torch.dtype): The default dtype at the call, which
            factories without a dtype and type promotion (``int * 0.5``)
            read; a replay runs under it (R4).
        switches (tuple): The backend switches at the call (oneDNN,
            deterministic algorithms, matmul precision, cuDNN, cuBLAS),
            which choose the kernel's algorithm; a replay runs under them
            (R4, :mod:`.backend_flags`).
    """
    __slots__ = ('func', 'args', 'kwargs', 'cost', 'rng', 'default_dtype',
                 'switches')

    def __init__(self, func, args, kwargs, cost, rng=None):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.cost, self.rng = cost, rng
        self.default_dtype = torch.get_default_dtype()
        self.switches = backend_flags.current()

    def refs(self):
        """Yield every reference among the arguments."""
        for a in (*self.args, *self.kwargs.values()):
            if isinstance(a, _REFS):
                yield a
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, _REFS):
                        yield b


class AllocNode:
    """Creator of a fresh buffer (``empty``, ``zeros`` and friends, R5)."""
    __slots__ = ('nbytes', 'device', 'cost')

    def __init__(self, nbytes, device):
        self.nbytes, self.device, self.cost = nbytes, device, 1.0

    def refs(self):
        return iter(())


class _UnrebuildableView(Exception):
    """A call reads or writes a recorded storage through a view the engine
    cannot rebuild (a conjugate or negative bit), or reads a sparse tensor:
    it gets no recipe (R4)."""


def _scratch_ref(a):
    return ScratchRef(detached_alias(a)) if isinstance(a, Tensor) else a


class Recipes:
    """Builds :class:`OpNode` recipes, and drops those no saved-tensor
    handle can reach (the sweep, a carried state's cut: R10); mixed into
    ``EngineState``.

    Reads the state's ``records``, ``external_users``,
    ``external_prune_at``, ``clock``, ``backward_clock``, ``reach_epoch``,
    ``unswept``, ``sweep_next``, ``cut_carried`` and ``lock``; sets
    ``cut_carried``, ``external_prune_at``, ``unswept``, ``sweep_next``,
    ``sweep_at`` and ``sweep_due``, and changes ``external_users`` in
    place; reads ``transients`` and sets ``unrecorded_tensors`` and
    ``unrecorded_prune_at`` (R13, R16). Calls the accounting
    (``_meter_rng_state``), the index of outside memory (``_index_held``,
    ``_unindex_held``) and the writes' ``_forget_if_unneeded``.
    """

    def _mutation_target(self, written, full_overwrite):
        for w in written:
            rec = self.records.get(w.untyped_storage()._cdata)
            if rec is not None and (rec.recomputable(rec.version) or
                                    (full_overwrite and rec.lo is None)):
                return rec.cdata
        return None

    def _make_node(self, func, args, kwargs, out, scratch, rng, target):
        """The recipe of a call, or ``None`` when it reads or writes a
        recorded storage through a view the engine cannot rebuild."""
        try:
            return self._node(func, args, kwargs, out, scratch, rng, target)
        except _UnrebuildableView:
            return None

    def _node(self, func, args, kwargs, out, scratch, rng, target):
        cost = op_cost(func, args, kwargs, out)
        self.cut_carried = False
        new_args, new_kwargs = self._refs(func, args, kwargs, scratch, target)
        if self.cut_carried:  # an earlier argument's record lost its recipe
            new_args, new_kwargs = self._refs(func, args, kwargs, scratch,
                                              target)
        if rng is not None:
            self._meter_rng_state(rng)
        return OpNode(func, new_args, new_kwargs, cost, rng)

    def _refs(self, func, args, kwargs, scratch, target):
        """The arguments of a call, tensors replaced by references."""
        if scratch:  # arguments written as a side effect get copies (R6)
            names = op_info(func).arg_names
            scratch_names = {names[i] for i in scratch}
            new_args = tuple(
                _scratch_ref(a) if i in scratch else self._ref_arg(a, target)
                for i, a in enumerate(args))
            new_kwargs = {
                k:
                _scratch_ref(v) if k in scratch_names else self._ref_arg(
                    v, target)
                for k, v in kwargs.items()
            }
        else:
            new_args = tuple([self._ref_arg(a, target) for a in args])
            new_kwargs = {
                k: self._ref_arg(v, target)
                for k, v in kwargs.items()
            }
        return new_args, new_kwargs

    def _ref_arg(self, a, target):
        if isinstance(a, Tensor):
            return self._ref(a, target)
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Tensor):
                    return type(a)([
                        self._ref(c, target) if isinstance(c, Tensor) else c
                        for c in a
                    ])
        return a

    def _ref(self, t, target):
        if not managed(t):  # held as it is (R4)
            if t.layout is not _STRIDED:
                # sparse: a write through its values() is not seen (no
                # storage to link, R7), nor its version checked (R13)
                raise _UnrebuildableView
            storage = t.untyped_storage()
            cdata = storage._cdata
            if cdata in self.records:
                # a conj/neg (or nested) view of a recorded storage:
                # held, it would read the storage as it is at the replay,
                # not the version the call read, and a write through it
                # would not go to the storage being rebuilt (R5)
                raise _UnrebuildableView
            # of a storage from outside: as any input from outside, held
            # and version-checked (R13; a conj view shares its base's
            # counter), or not at all (memory torch may not own, R4)
            return self._held_external(t, storage, cdata)
        storage = t.untyped_storage()
        cdata = storage._cdata
        if cdata == target:
            return SelfRef(view_meta(t))
        rec = self.records.get(cdata)
        if rec is None:
            return self._held_external(t, storage, cdata)
        rec.last_access = self.clock
        if rec.born < self.backward_clock != rec.carried_check \
                and rec.lo is not None:
            self._cut_carried(rec)
        rec.sync()  # read as it is: a write unseen after is refused (R13)
        if rec.recomputable(rec.version):
            return RecordRef(rec, rec.version, view_meta(t))
        return HeldRef(detached_alias(t), rec, rec.version)

    def _held_external(self, t, storage, cdata):
        """A hold on ``t``, whose storage (``cdata``) the engine did not
        record, checked at replay for writes made unseen (R13).

        Raises:
            _UnrebuildableView: If the storage may wrap memory torch did
                not allocate (not resizable: ``torch.from_numpy``, DLPack)
                and ``t`` is data, not a parameter (no grad required; a
                parameter's storage becomes not resizable after
                ``.numpy()`` or ``load_state_dict(assign=True)``, found by a
                review) nor a DataLoader worker's batch (shared memory):
                NumPy may write it, unseen, before a rebuild reads it (a
                target buffer refilled per image; found by an adversarial
                search), so the call is kept (R4).
        """
        if not storage.resizable() and not t.requires_grad and \
                not t.is_shared():
            raise _UnrebuildableView
        if t.is_inference():  # no version counter (no grad_fn either)
            return HeldRef(t, None, None)
        # the tensors ops in scope returned over it are checked after the
        # scope, as a record's are (R13, R16)
        tracked = self.unrecorded_tensors_of(cdata, storage)
        if _is_leaf(t):  # holding a leaf makes no cycle
            return HeldRef(t, None, t._version, cdata, tracked=tracked)
        # t itself, and its base if it is a view, are read through weak
        # references while they view the held storage (a base moved to
        # another storage by .data = or set_ is not)
        base = t._base
        wrefs = (weakref.ref(t), ) if base is None else \
            (weakref.ref(t), weakref.ref(base))
        if base is not None and _is_leaf(base):  # w.t() of a parameter
            return HeldRef(
                detached_alias(t),
                None,
                t._version,
                None,
                wrefs,
                tracked,
                leaf=base)
        # the alias shares t's counter, read once they are gone
        return HeldRef(
            counter_sharing_alias(t), None, t._version, None, wrefs, tracked)

    def unrecorded_tensors_of(self, cdata, storage):
        """The :class:`~mmdtr.core.tracked_tensors.UnrecordedTensors` of
        ``storage`` (StorageImpl pointer ``cdata``), which has no record,
        made on first use with the tensor that made the storage if an op
        before recording started did (R13, R16). That of a storage from
        outside the scope is replaced once the storage is freed (its
        pointer may be reused; found by a review), and such entries are
        dropped when the table has doubled, so a long scope does not grow
        it (R10); a transient's goes when it is freed."""
        table = self.unrecorded_tensors
        tracked = table.get(cdata)
        if tracked is not None and not tracked.stale():
            return tracked
        if len(table) >= self.unrecorded_prune_at:
            self.unrecorded_tensors = table = {
                k: v
                for k, v in table.items() if not v.stale()
            }
            self.unrecorded_prune_at = max(64, 2 * len(table))
        transient = self.transients.get(cdata)
        tracked = table[cdata] = UnrecordedTensors(
            cdata, None if transient is not None else weakref.ref(storage))
        maker = getattr(transient, 'maker', None)
        maker = maker() if maker is not None else None
        if maker is not None and maker.untyped_storage()._cdata == cdata:
            tracked.track(maker)
        return tracked

    def _cut_carried(self, rec):
        """``rec``, made before the latest backward, is read again: a state
        carried across iterations (a running mean, a memory). If nothing can
        ask to rebuild it or what its recipe reaches (no saved-tensor
        handle), their recipes go: each iteration's recipe would otherwise
        read the last one's, chaining every iteration's inputs together
        (R10). Checked once per backward."""
        rec.carried_check = self.backward_clock
        if self._forget_if_unneeded(rec):
            self.cut_carried = True

    def _sweep(self):
        """Saved tensors were released or a backward read them (a graph was
        dropped, or a backward ran): records given a recipe before that which
        no saved-tensor handle can reach lose their recipes, with those of the
        records reading them. Kept across the iterations of one long scope (a
        list of detached outputs, a total carried out of place), their recipes
        would hold every iteration's inputs (R10). A record made since the
        latest backward is checked one sweep later than one made before it: a
        graph dropped mid-forward (an auxiliary loss read with ``.item()``)
        sweeps too, and the running forward's activations not saved yet must
        keep their recipes. A record a handle still reaches is checked again at
        the next sweep; a sweep runs as many ops after the last as it left
        records to check, at the earliest, so sweeping costs O(1) per op
        amortized, walks aside (R1)."""
        self.sweep_due = False
        later = WeakList()
        check = self.sweep_next.live()
        for rec in self.unswept.live():
            if rec.born < self.backward_clock:
                check.append(rec)
            else:
                later.add(rec)
        for rec in check:
            if rec.lo is None:
                continue  # unrecomputable already
            if not self._forget_if_unneeded(rec):
                later.add(rec)
        self.unswept, self.sweep_next = WeakList(), later
        self.sweep_at = self.clock + len(later)

    def _link(self, rec, node):
        """Record ``rec`` as a user of every storage ``node`` reads."""
        for ref in node.refs():
            input_rec = getattr(ref, 'record', None)
            if input_rec is not None:
                if input_rec is not rec:
                    rec.add_input(input_rec)
            elif isinstance(ref, HeldRef) and \
                    ref.tensor.layout is _STRIDED:  # sparse: no storage
                storage = ref.tensor.untyped_storage()
                entry = self.external_users.get(storage._cdata)
                if entry is None:
                    if len(self.external_users) >= self.external_prune_at:
                        self._prune_external_users()
                    wref = StorageRef(storage, self._forget_external)
                    wref.cdata, wref.nbytes = storage._cdata, 0
                    self._index_held(wref, storage)  # (R14)
                    entry = self.external_users[storage._cdata] = (WeakList(),
                                                                   wref)
                entry[0].add(rec)

    def _prune_external_users(self):
        """Drop the outside storages no live recipe reads any more, when
        the table has doubled since the last pruning (O(1) amortized): a
        long scope reading another preloaded batch each iteration grew it
        by one entry per iteration (found by an adversarial search)."""
        table = self.external_users
        for cdata, entry in list(table.items()):  # a snapshot (R12)
            # a collection in live() may free the storage: its callback then
            # dropped the entry (found by a review)
            if not entry[0].live() and table.get(cdata) is entry:
                del table[cdata]  # its wref dies uncalled
                self._unindex_held(entry[1])
        self.external_prune_at = max(64, 2 * len(self.external_users))

    def _forget_external(self, wref):
        with self.lock:  # any thread may free it (R12)
            entry = self.external_users.get(wref.cdata)
            if entry is not None and entry[1] is wref:
                del self.external_users[wref.cdata]
            self._unindex_held(wref)
