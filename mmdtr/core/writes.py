"""In-place writes: versions, and what must happen before a storage changes.

The write half of :class:`~mmdtr.core.engine.EngineState` (one state object
per engine; this mixin only groups its methods). Rules R5 and R7 of
docs/design.md.
"""
from .cost_model import tensor_bytes
from .records import AllocNode, view_meta


class Writes:
    """Versions storages across in-place writes; mixed into ``EngineState``.

    Uses the state's ``records``, ``external_users``, ``materialize`` and
    ``_drop_candidate``.
    """

    def _before_write(self, t):
        cdata = t.untyped_storage()._cdata
        rec = self.records.get(cdata)
        if rec is not None:
            if rec.recomputable(rec.version) or not rec.users:
                return
            users = rec.live_users()
        else:
            entry = self.external_users.get(cdata)
            if entry is None:
                return
            users = entry[0].live()
        for user in users:
            self._freeze(user)

    def _freeze(self, rec):
        """An input of ``rec`` is about to change for good (R7).

        A record something may still rebuild is kept resident for good; one
        nothing can ask for any more is only made unrecomputable, with all
        it reaches, without being rebuilt.
        """
        if rec.keepalive is not None or rec.lo is None:
            return
        unneeded = self._unneeded_from(rec)
        if unneeded is not None:
            for dead in unneeded:
                dead.make_unrecomputable()
                if dead.cand_index >= 0:
                    self._drop_candidate(dead)
            return
        if rec.resident:
            storage = rec.storage()
        elif rec.recomputable(rec.version):
            storage = self.materialize(rec, rec.version)
        else:  # freed, and its current version cannot be rebuilt; its
            storage = None  # users that read an older one still can
        if storage is not None:
            rec.keepalive = storage  # pinned from here on
            if rec.cand_index >= 0:
                self._drop_candidate(rec)
        for user in rec.live_users():
            if user.lo is not None:  # may rebuild from an older version
                self._freeze(user)  # of rec: its range goes last
        rec.make_unrecomputable()

    @staticmethod
    def _unneeded_from(rec):
        """``rec`` and the records whose recipes reach it, if none of them
        has a saved-tensor handle (so nothing can ask to rebuild any of
        them), else ``None``. Frozen and unrecomputable records end the
        walk: what reads them never needs what is behind them."""
        seen, stack = {id(rec): rec}, [rec]
        while stack:
            r = stack.pop()
            if r.handles:
                return None
            for user in r.live_users():
                if user.lo is not None and user.keepalive is None \
                        and id(user) not in seen:
                    seen[id(user)] = user
                    stack.append(user)
        return list(seen.values())

    def _after_write(self, t, node, info, versioned=True):
        """Version ``t``'s storage after a write; ``node`` replays it
        (``None``: not replayable). ``versioned``: autograd bumps the
        version of what the call writes (not for fused optimizer steps or
        batch norm's running statistics), so saved tensors check it (R10).
        """
        rec = self.records.get(t.untyped_storage()._cdata)
        if rec is None:
            return
        if versioned and rec.handles:  # for SavedTensors.unpack (R10)
            if rec.saved_writes is None:
                rec.saved_writes = []
            rec.saved_writes.append((rec.version + 1, view_meta(t)))
        if node is not None and rec.lo is None and info.full_overwrite \
                and t.is_contiguous() and t.storage_offset() == 0 \
                and tensor_bytes(t) == rec.nbytes:
            # an uninitialized storage is now fully determined (R5)
            rec.creator = AllocNode(rec.nbytes, rec.device)
            rec.base, rec.mutations, rec.lo = rec.version, (), rec.version
            rec.cost = 1.0
        rec.version += 1
        if node is not None and rec.recomputable(rec.version - 1):
            if rec.mutations:
                rec.mutations.append(node)
            else:
                rec.mutations = [node]
            rec.cost += node.cost
            self._link(rec, node)
        elif rec.lo is not None and rec.hi is None:
            rec.hi = rec.version - 1  # older versions stay recomputable
            if rec.cand_index >= 0:
                self._drop_candidate(rec)
