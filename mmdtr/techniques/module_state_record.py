"""The versions of a checkpointed module's parameters and buffers between
its forward and its recompute (:class:`StateRecord`), one record per module
shared by its calls; :class:`~.recompute_guards.RecomputeContext` asks it
what changed before a recompute.
"""
import weakref
from typing import Optional, Sequence, Tuple

import torch.nn as nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import UninitializedTensorMixin

from .recompute_guards import NORM_BUFFERS


class StateRecord:
    """The versions of a checkpointed module's parameters, and of the
    buffers its recompute reads, as its latest forward or recompute left
    them, shared by its calls.

    The buffers are all but the running statistics of the norm layers that
    update them (``tracking_norms`` of :mod:`.recompute_guards`: their
    recompute runs on scratch copies and reads batch statistics). A buffer
    written between the forward and backward (a frozen BN's statistics
    recalibrated, a shift set by a hook) was read live by the recompute:
    other gradients, silently (found by an adversarial search).

    Its own writes (``Embedding(max_norm=...)`` renormalizes its weight in
    each forward and recompute) move the record along; a write by anything
    else is seen at the module's next forward (the generation changes: the
    calls before it may not recompute) or at a recompute (found by
    adversarial searches and a review: a parameter stepped in backward, or
    written between two calls, was read by the earlier call's recompute).
    """

    def __init__(self):
        # (weak tensor, version, weak owner, '_parameters' or '_buffers',
        # name, qualified name) per watched tensor
        self.watched, self.generation = [], 0
        # calls that updated running statistics an earlier call had read
        # (in eval mode), and the latest such statistic's name
        self.switches, self.switched = 0, None
        # whether the latest call's forward reads running statistics
        self.reads_statistics = False
        # parameters and buffers not made yet (lazy modules'): left by the
        # latest call run without checkpoint, and at the latest forward
        self.lazy_left, self.lazy_at_forward = None, 0

    def update(
        self,
        module: Optional[nn.Module] = None,
        norms: Sequence[_NormBase] = ()
    ) -> int:
        """Record the current versions.

        Args:
            module (nn.Module, optional): Watch its parameters and buffers
                anew. By default the tensors already watched (those still
                alive) are recorded again.
            norms (Sequence[_NormBase]): With ``module``: the norm layers
                whose running statistics are not watched.

        Returns:
            int: With ``module``, how many of its parameters and buffers
            are not made yet (lazy); else 0.
        """
        if module is None:
            self.watched = [(ref, ref()._version, *place)
                            for ref, _, *place in self.watched
                            if ref() is not None]
            return 0
        self.watched, lazy = _watch(module, norms)
        return lazy

    def _first_changed(self, tables=('_parameters', '_buffers')):
        """The entry of the first watched tensor of ``tables`` written in
        place or replaced (a buffer rebound, found by a review) since the
        record, or None."""
        for entry in self.watched:
            ref, version, owner_ref, table, name, _ = entry
            if table not in tables:
                continue
            t, owner = ref(), owner_ref()
            if owner is not None and getattr(owner, table).get(name) is not t:
                return entry
            if t is not None and t._version != version:
                return entry
        return None

    def _changed(self) -> Optional[str]:
        """The qualified name of a watched tensor changed since the record,
        or None."""
        entry = self._first_changed()
        return None if entry is None else entry[-1]

    def written_buffer(self) -> Optional[str]:
        """``'Owner.name'`` of a buffer written in place or replaced since
        the record, or None: after a forward, before :meth:`update`, one
        the forward itself updated (an EMA, a counter), which its recompute
        would read updated and update again.

        Returns:
            str | None: The first such buffer's ``'Owner.name'``, or None.
        """
        entry = self._first_changed(('_buffers', ))
        if entry is None:
            return None
        owner = entry[2]()
        return f'{type(owner).__name__}.{entry[4]}'

    def note_forward(self, module: nn.Module,
                     norms: Sequence[_NormBase]) -> bool:
        """At a forward's start: a write since the record is not the
        module's own.

        A tensor written or replaced since the record starts a new
        generation; the record then watches ``module``'s tensors as they
        are.

        Args:
            module (nn.Module): The checkpointed module.
            norms (Sequence[_NormBase]): Its norm layers that update
                running statistics
                (:func:`~.recompute_guards.tracking_norms`).

        Returns:
            bool: False, with nothing recorded, if a parameter or buffer of
            ``module`` is not made yet (a lazy module's, before its first
            call) and the last call run without checkpoint did not leave it
            so: this call is not to be checkpointed (set :attr:`lazy_left`
            after it). A lazy sub-module the forward never calls stays
            unmade, and later calls are checkpointed.
        """
        watched, lazy = _watch(module, norms)
        if lazy and lazy != self.lazy_left:
            return False
        self.lazy_at_forward = lazy
        if self._changed() is not None:
            self.generation += 1
        read = self._statistics_read_before(norms)
        if read is not None:
            # a call before read them (in eval mode); this one updates them
            # (in training mode): the recompute of those that read them may
            # not run, that of the others may (found by reviews)
            self.switches, self.switched = self.switches + 1, read
        self.watched = watched
        self.reads_statistics = any(
            table == '_buffers' and name in NORM_BUFFERS
            for _, _, _, table, name, _ in watched)
        return True

    def _statistics_read_before(self, norms: Sequence[_NormBase]):
        """The qualified name of a running statistic the record watches
        (read by an earlier call: its norm was not updating it) that one of
        ``norms`` updates now, or None."""
        updating = {id(norm) for norm in norms}
        for _, _, owner_ref, table, name, qualified in self.watched:
            if table == '_buffers' and name in NORM_BUFFERS \
                    and id(owner_ref()) in updating:
                return qualified
        return None

    def changed_since(self, generation: int) -> Optional[str]:
        """What was written or replaced since the record, or since the call
        of ``generation``, for a message.

        Args:
            generation (int): The record's generation when the call's
                forward ended.

        Returns:
            str | None: ``"'conv.weight'"`` for a tensor written or replaced
            since the record; if none is but ``generation`` is not the
            current one, a tensor written between the calls; else None.
        """
        changed = self._changed()
        if changed is not None:
            return repr(changed)
        if generation != self.generation:
            return 'a parameter or buffer, between two of its calls,'
        return None

    def statistics_updated_since(self,
                                 switches: Optional[int]) -> Optional[str]:
        """The qualified name of a running statistic a later call updated
        in training mode since a call read statistics (in eval mode) when
        :attr:`switches` was ``switches``, or None (also for a call that
        read none: ``switches`` None)."""
        if switches is None or self.switches == switches:
            return None
        return self.switched


def _watch(module: nn.Module, norms: Sequence[_NormBase]) -> Tuple[list, int]:
    """The entries of :class:`StateRecord` for ``module``'s parameters and
    buffers but the running statistics of ``norms``, and how many are not
    made yet (``UninitializedParameter``: no shape, no version; not
    watched)."""
    guarded = {id(norm) for norm in norms}
    watched, lazy = [], 0
    for prefix, owner in module.named_modules():
        for table in ('_parameters', '_buffers'):
            for name, t in getattr(owner, table).items():
                if isinstance(t, UninitializedTensorMixin):
                    lazy += 1
                    continue
                if t is None or t.is_inference() or (table == '_buffers'
                                                     and id(owner) in guarded
                                                     and name in NORM_BUFFERS):
                    continue
                watched.append(
                    (weakref.ref(t), t._version, weakref.ref(owner), table,
                     name, f'{prefix}.{name}' if prefix else name))
    return watched, lazy


#: module -> its :class:`StateRecord`
_STATE_VERSIONS = weakref.WeakKeyDictionary()


def state_record(module: nn.Module) -> StateRecord:
    """The :class:`StateRecord` of ``module``'s calls.

    Args:
        module (nn.Module): The checkpointed module.

    Returns:
        StateRecord: The one kept for ``module`` (weakly keyed), made on
        first use.
    """
    record = _STATE_VERSIONS.get(module)
    if record is None:
        record = _STATE_VERSIONS[module] = StateRecord()
    return record
