"""Recipes: how an op's call is recorded so that it can be replayed.

The recipe half of :class:`~mmdtr.core.engine.EngineState` (one state
object per engine; this mixin only groups its methods): each tensor
argument of a recorded call becomes a reference that says how to get it back
at the version the call read (rule R4 of docs/design.md), and the records
are linked both ways to the records their recipes read (R8, R10).
"""
import torch

from .cost_model import op_cost
from .op_semantics import op_info
from .records import (HeldRef, OpNode, RecordRef, ScratchRef, SelfRef,
                      StorageRef, UserRefs, detached_alias, managed, view_meta)

Tensor = torch.Tensor
_STRIDED = torch.strided


def _scratch_ref(a):
    return ScratchRef(detached_alias(a)) if isinstance(a, Tensor) else a


class Recipes:
    """Builds :class:`~mmdtr.core.records.OpNode` recipes; mixed into
    ``EngineState``.

    Uses the state's ``records``, ``external_users`` and ``clock``.
    """

    def _mutation_target(self, written, full_overwrite):
        for w in written:
            rec = self.records.get(w.untyped_storage()._cdata)
            if rec is not None and (rec.recomputable(rec.version) or
                                    (full_overwrite and rec.lo is None)):
                return rec.cdata
        return None

    def _make_node(self, func, args, kwargs, out, scratch, rng, target):
        cost = op_cost(func, args, kwargs, out)
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
        return OpNode(func, new_args, new_kwargs, cost, rng)

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
            return HeldRef(detached_alias(t), None, None)
        cdata = t.untyped_storage()._cdata
        if cdata == target:
            return SelfRef(view_meta(t))
        rec = self.records.get(cdata)
        if rec is not None:
            rec.last_access = self.clock
            if rec.recomputable(rec.version):
                return RecordRef(rec, rec.version, view_meta(t))
            return HeldRef(detached_alias(t), rec, rec.version)
        if t.grad_fn is None:  # a leaf: holding it makes no cycle
            return HeldRef(t, None, t._version, cdata)
        # below autograd, detach() gets a fresh version counter: no check
        return HeldRef(detached_alias(t), None, None)

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
                    wref = StorageRef(storage, self._forget_external)
                    wref.cdata, wref.nbytes = storage._cdata, 0
                    entry = self.external_users[storage._cdata] = (UserRefs(),
                                                                   wref)
                entry[0].add(rec)

    def _forget_external(self, wref):
        self.external_users.pop(wref.cdata, None)
