"""In-place writes: versions, and what must happen before a storage changes.

The write half of :class:`~mmdtr.core.engine.EngineState` (one state object
per engine; this mixin only groups its methods). Rules R5 and R7 of
docs/design.md.
"""
from collections import deque

import torch

from .arguments import tensors_in
from .cost_model import tensor_bytes
from .op_semantics import batch_norm_in_training, get_arg
from .recipe_refs import HeldRef, SelfRef
from .recipes import AllocNode
from .records import _PLAIN
from .tracked_tensors import stays_on

#: The mutation log of a storage made before the latest backward stops
#: growing here once nothing can ask for its older versions: the record is
#: made unrecomputable instead (kept while alive). A tensor carried across
#: the iterations of one long scope and written in place each time (an EMA
#: centre, an RNN state) would otherwise keep every iteration's inputs
#: (R5). Activations of the running forward are never capped.
MAX_MUTATIONS = 8


def versions_before(written) -> tuple:
    """The tensors of a list-writing op that have version counters
    (inference tensors have none), and their versions before the call."""
    counted = [t for t in written if not t.is_inference()]
    return counted, [t._version for t in counted]


def bump_like_eager(written, versions) -> None:
    """Bump the version counters of a list-writing op as eager does.

    Eager autograd bumps the counter of each tensor an in-place
    ``_foreach_`` op writes, once per element (a tensor listed twice, or
    two views of one base, twice); below a dispatch mode their kernels bump
    none. The saved-tensor check reads the counters (R10), and so may the
    user: they move as in eager.

    Args:
        written (list): The tensors written, inference tensors left out
            (they have no counter).
        versions (list): Their versions before the call.
    """
    if all(t._version == v for t, v in zip(written, versions)):
        for t in written:
            torch.autograd.graph.increment_version(t)


def storage_set_made(info, args, kwargs):
    """The new, empty storage ``t.set_()`` (no source) pointed ``t`` at,
    once it ran; ``None`` for ``set_`` from a source (R11)."""
    if len(args) + len(kwargs) != 1:
        return None
    return get_arg(info, args, kwargs, 0).untyped_storage()


def _frozen(rec) -> bool:
    """Whether ``rec`` is frozen or unrecomputable: it reads nothing again
    (R7)."""
    return rec.lo is None


def _holds_younger_storage(node, born) -> bool:
    """Whether the write ``node`` holds a storage allocated in scope after
    ``born`` that has no recipe at the version it read (``HeldRef.record``:
    made under ``no_grad``, by backward, ...): logged, it would keep that
    storage alive as long as the older one it writes (R5)."""
    return any(
        type(ref) is HeldRef and ref.record is not None
        and ref.record.born > born for ref in node.refs())


def _reads_only_self(node) -> bool:
    """Whether the write ``node`` reads the storage it writes only through
    the tensor it writes, which a whole overwrite does not read:
    ``x.fill_(x[3])`` or ``p.bernoulli_(p)`` read it through another
    argument, and rebuilt from an empty buffer they would read garbage."""
    return sum(isinstance(ref, SelfRef) for ref in node.refs()) == 1


def _has_storage(t) -> bool:
    """Whether ``t`` has a real storage (wrapper subclasses have none)."""
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def written_parts(t) -> list:
    """What a write to ``t`` writes: the tensors a traceable wrapper
    subclass holds (``__tensor_flatten__``), theirs in turn, else ``t`` if
    it has a storage (an opaque wrapper's parts are unknown). The subclass
    writes them in its own dispatch, where the engine sees nothing, and a
    recipe that read one rebuilt from the new values (found by a review).
    """
    flatten = getattr(t, '__tensor_flatten__', None)
    if flatten is not None and type(t) not in _PLAIN:
        inner = (getattr(t, name, None) for name in flatten()[0])
        # an optional part may be None (a review)
        return [
            part for p in inner if isinstance(p, torch.Tensor)
            for part in written_parts(p)
        ]
    return [t] if _has_storage(t) else []


class Writes:
    """Versions storages across in-place writes; mixed into ``EngineState``.

    Uses the state's ``records``, ``external_users``, ``materialize`` and
    ``_drop_candidate``.
    """

    @staticmethod
    def _writes(info, args, kwargs):
        """Tensors the call writes: declared ones first, then side effects
        (batch norm's running statistics in training mode, R6; the lists of
        foreach and fused optimizer steps, R7). Lists are flattened. The
        parts of a sparse tensor written come last, as side effects: its
        values may be a recorded tensor's storage (``sparse_coo_tensor(i,
        h)`` shares ``h``), which ``div_`` writes (found by an adversarial
        search)."""
        parts = []
        writes = tensors_in(
            (get_arg(info, args, kwargs, i) for i in info.written_args), parts)
        n_declared, scratch = len(writes), ()
        if info.side_effect_args and (info.batch_norm_training_arg is None
                                      or batch_norm_in_training(
                                          info, args, kwargs)):
            scratch = info.side_effect_args
            writes += tensors_in(
                (get_arg(info, args, kwargs, i) for i in scratch), parts)
        return writes + parts, n_declared, scratch

    def _before_write(self, t):
        storage = t.untyped_storage()
        cdata = storage._cdata
        rec = self.records.get(cdata)
        if rec is not None:  # counters move: a write the engine sees (R13)
            rec.unsync()
        self._freeze_readers(cdata)
        for other in self._sharing_memory(storage, cdata):  # (R14)
            self._freeze_readers(other)

    def _freeze_readers(self, cdata):
        """Freeze the records reading storage ``cdata`` at a version that
        cannot be rebuilt, before it is written (R7)."""
        rec = self.records.get(cdata)
        if rec is not None:
            if rec.recomputable(rec.version) or not rec.users:
                return
            readers = rec.users
        else:
            entry = self.external_users.get(cdata)
            if entry is None:
                return
            readers = entry[0]
        for user in readers.live():
            self._freeze(user)
        # a frozen reader never reads the storage again: the next write
        # does not walk it (K reads, each followed by a write, walked K^2
        # readers before; found by an audit of the hot path, R1)
        readers.prune(_frozen)

    def _freeze(self, rec):
        """An input of ``rec`` is about to change for good (R7).

        A record something may still rebuild is kept resident while its
        saved tensors live, and so are its users, which may rebuild from
        an older version of it: each loses its recomputable range only
        after all its users (depth first, without recursion: chains are
        long, and an in-place write reading its own storage makes a cycle).
        One nothing can ask for any more is only made unrecomputable, with
        all it reaches, without being rebuilt.
        """
        stack, seen = [(rec, False)], set()
        while stack:
            rec, users_done = stack.pop()
            if users_done:
                rec.make_unrecomputable()
                continue
            if rec.lo is None or id(rec) in seen:  # unrecomputable or
                continue  # frozen already, or being frozen
            seen.add(id(rec))
            if self._forget_if_unneeded(rec):
                continue
            self._pin_frozen(rec)
            stack.append((rec, True))
            stack.extend((user, False) for user in rec.live_users()
                         if user.lo is not None)

    def _pin_frozen(self, rec):
        """Keep ``rec`` resident while its saved tensors live (release
        lets it go); a record without handles keeps nothing: only its
        users may ask for it, and they are frozen too (R7)."""
        if not rec.handles:
            storage = None
        elif rec.resident:
            storage = rec.storage()
        elif rec.recomputable(rec.version):
            storage = self.materialize(rec, rec.version)
        else:  # freed, and its current version cannot be rebuilt; its
            storage = None  # users that read an older one still can
        if storage is not None:
            rec.keepalive = storage
        if rec.cand_index >= 0:
            self._drop_candidate(rec)

    def _forget_if_unneeded(self, rec) -> bool:
        """Drop the recipes of ``rec`` and of the records reading it if no
        saved-tensor handle can ask for any of them (``_unneeded_from``);
        whether it did (R5, R7, R10)."""
        unneeded = self._unneeded_from(rec)
        if unneeded is None:
            return False
        for r in unneeded:
            r.make_unrecomputable()
            if r.cand_index >= 0:
                self._drop_candidate(r)
        return True

    def _unneeded_from(self, rec):
        """``rec`` and the records whose recipes reach it, if none of them
        has a saved-tensor handle (so nothing can ask to rebuild any of
        them), else ``None``. Frozen and unrecomputable records end the
        walk: what reads them never needs what is behind them.

        A walk that finds a handle marks the records on its path as
        reaching one (``reaches``), which ends later walks there: without
        it, N records of a chain read in turn walked it N times (R1). The
        marks hold until a record's last handle goes (``reach_epoch``); one
        left stale by a recipe dropped since only keeps more (R7, R10). The
        walk goes breadth first, looking at a record's users as it queues
        them, so a handle a few steps away is found before a long chain
        beside it is walked (R10's sweep walks from many records).
        """
        epoch = self.reach_epoch
        if rec.handles or rec.reaches == epoch:
            rec.reaches = epoch
            return None
        parent, walked = {id(rec): None}, [rec]
        queue = deque([rec])
        while queue:
            r = queue.popleft()
            for user in r.live_users():
                if user.lo is not None and id(user) not in parent:
                    parent[id(user)] = r
                    if user.handles or user.reaches == epoch:
                        while user is not None:  # its path reaches one
                            user.reaches = epoch
                            user = parent[id(user)]
                        return None
                    walked.append(user)
                    queue.append(user)
        return walked

    def _after_write(self, t, node, info):
        """Version ``t``'s storage after a write; ``node`` replays it
        (``None``: not replayable)."""
        storage = t.untyped_storage()
        for other in self._sharing_memory(storage, storage._cdata):
            shared = self.records.get(other)  # written too (R14)
            if shared is not None:
                shared.version += 1
                shared.unsync()
                self._cap_hi(shared)
        rec = self.records.get(storage._cdata)
        if rec is None:  # one counted without a record may have grown
            self.recount_transient(storage)  # (R11, R16; found by a review)
            return
        if storage.nbytes() != rec.nbytes:
            # resized in place (resize_, out= into a smaller tensor): the
            # meter follows (R11); no recipe rebuilds the new size (R5)
            self.resized(rec, storage.nbytes(), rec.device)
            node = None
        elif node is not None and (rec.lo is None or rec.recomputable(
                rec.version)) and _holds_younger_storage(node, rec.born):
            node = None  # not logged: caps hi (R5)
        if node is not None and rec.lo is None and info.full_overwrite \
                and t.is_contiguous() and t.storage_offset() == 0 \
                and tensor_bytes(t) == rec.nbytes and _reads_only_self(node):
            # an uninitialized storage is now fully determined (R5)
            rec.creator = AllocNode(rec.nbytes, rec.device)
            rec.base, rec.mutations, rec.lo = rec.version, (), rec.version
            rec.cost, rec.recipe_nbytes = 1.0, rec.nbytes
            self.unswept.add(rec)
        rec.version += 1
        rec.unsync()
        if node is not None and rec.recomputable(rec.version - 1):
            if len(rec.mutations) >= MAX_MUTATIONS \
                    and rec.born < self.backward_clock:
                if self._forget_if_unneeded(rec):  # a state carried
                    return  # across iterations (R5)
            if rec.mutations:
                rec.mutations.append(node)
            else:
                rec.mutations = [node]
            rec.cost += node.cost
            self._link(rec, node)
        else:
            self._cap_hi(rec)

    def _cap_hi(self, rec):
        """``rec`` was written by what no recipe replays: its versions
        before stay recomputable, the one now does not (R5)."""
        if rec.lo is not None and rec.hi is None:
            rec.hi = rec.version - 1
            if rec.cand_index >= 0:
                self._drop_candidate(rec)

    def _after_failed_write(self, written, info):
        """An op raised: it may have written a part of what it writes, so
        those versions are never replayed (R5). (A failure before any
        write, an out-of-memory error say, keeps them resident all the
        same: exact, at a cost in memory.)"""
        for t in written:
            self._after_write(t, None, info)

    def _run_set(self, func, args, kwargs, info):
        """Run ``t.set_(...)``, which points ``t`` at another storage.

        No storage's bytes change: nothing is versioned (autograd bumps
        ``t``'s version counter, which the saved-tensor check reads, R10).
        But recipes hold a leaf from outside as the tensor itself (R4),
        which then reads other bytes: the records reading ``t``'s storage
        are frozen first, as before a write (R7). ``t.set_()`` makes a new,
        empty storage: it is registered, so that growing it later is
        metered (R11). ``t``, which has a counter of its own, is tracked
        over the storage it now shows, as the views ops return are: a write
        through it after the scope is seen (R13; found by an adversarial
        search: a rebuild read the bytes it wrote).
        """
        t = get_arg(info, args, kwargs, 0)
        self._before_write(t)
        out = self._run(func, args, kwargs)
        self.clock += 1
        storage = storage_set_made(info, args, kwargs)
        if storage is not None and storage._cdata not in self.records:
            self._register(storage, storage._cdata)
        if type(t) not in _PLAIN:  # a wrapper subclass has no storage
            return out
        storage = t.untyped_storage()
        cdata = storage._cdata
        if not stays_on(t, cdata):
            return out  # a view of a base elsewhere: its writes move t's
            # counter, and would read as writes here (found by a review)
        rec = self.records.get(cdata)
        if rec is None:
            rec = self.unrecorded_tensors_of(cdata, storage)
        rec.track(t)
        return out
