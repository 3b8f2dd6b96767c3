"""What a checkpointed module's recompute may not change a second time.

Activation checkpointing runs a module's forward twice: once in the
forward pass and once, to rebuild its activations, during the backward.
Whatever that forward writes besides its outputs is written twice:

- the running statistics of normalization layers in training mode: the
  recompute writes into throw-away copies (:class:`RunningStatsGuard`), since
  their outputs do not depend on them;
- any other buffer (an EMA, a call counter): the recompute would read the
  updated value, so its activations and gradients would differ; it is
  refused (:meth:`StateRecord.written_buffer`).

And what the recompute reads must not have changed since the forward: a
parameter or input written in place in between is refused when backward
would recompute (:class:`RecomputeContext`). What the recompute puts back
as its forward had it (generators, train/eval modes) is in
:mod:`.recompute_put_back`.
"""
import weakref
from contextlib import ExitStack
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import UninitializedTensorMixin

from mmdtr.errors import MmdtrError
from .recompute_put_back import GeneratorStates, TrainingModes

#: The buffers of a normalization layer that its training forward updates.
NORM_BUFFERS = ('running_mean', 'running_var', 'num_batches_tracked')


def tracking_norms(module: nn.Module) -> List[_NormBase]:
    """The normalization layers in ``module`` that update running stats.

    Args:
        module (nn.Module): The module whose submodules (itself included)
            are searched.

    Returns:
        list[_NormBase]: The norm layers in training mode that track
        running statistics and have a ``running_mean``.
    """
    return [
        m for m in module.modules() if isinstance(m, _NormBase) and m.training
        and m.track_running_stats and m.running_mean is not None
    ]


class RunningStatsGuard:
    """During the recompute, give norm layers throw-away running buffers.

    A norm layer in training mode normalizes with batch statistics and
    updates its running buffers in place. The recompute must produce the
    same output and save the same number of tensors for backward, but must
    not update the buffers a second time; so each buffer is swapped for a
    copy while the recompute runs and restored afterwards. The copies are
    of the buffers as the forward found them (taken when the guard is made,
    at the forward's start): a module reading them (a BatchRenorm-style
    layer, ``bn(x) * bn.running_var``) then reads in the recompute what it
    read in the forward; copies of the updated buffers gave other
    gradients, silently (found by a review). Re-entrant, so a
    ``retain_graph=True`` double backward works too.

    Args:
        norms (list[_NormBase]): The norm layers that track running stats
            and are in training mode for the forward.
    """

    def __init__(self, norms: List[_NormBase]):
        self.norms = norms
        # a few numbers per channel, kept until the graph goes
        self._before = [
            (norm, name, buffer.clone()) for norm in norms
            for name in NORM_BUFFERS
            if isinstance(buffer := getattr(norm, name, None), torch.Tensor)
        ]
        self._stack: List[list] = []

    def __enter__(self) -> 'RunningStatsGuard':
        saved = []
        for norm, name, before in self._before:
            saved.append((norm, name, getattr(norm, name)))
            setattr(norm, name, before.clone())
        self._stack.append(saved)
        return self

    def __exit__(self, *exc_info) -> None:
        for norm, name, buffer in self._stack.pop():
            setattr(norm, name, buffer)


def watch_versions(tensors) -> list:
    """``(weak reference, version)`` of each tensor among ``tensors`` that
    has a version counter. Weak: a strong reference held until backward
    kept the module's inputs visible, so DTR could not evict them.

    Args:
        tensors (Iterable): Any values; those that are tensors and not
            inference tensors are watched.

    Returns:
        list[tuple]: ``(weakref.ref(tensor), tensor._version)`` pairs.
    """
    return [(weakref.ref(t), t._version) for t in tensors
            if isinstance(t, torch.Tensor) and not t.is_inference()]


def written_since(watched: list) -> Optional[torch.Tensor]:
    """A live tensor of ``watched`` written in place since, or ``None``.

    Args:
        watched (list): ``(weak reference, version)`` pairs from
            :func:`watch_versions`.

    Returns:
        Tensor | None: The first tensor still alive whose version differs
        from the recorded one, or None.
    """
    for ref, version in watched:
        t = ref()
        if t is not None and t._version != version:
            return t
    return None


class RecomputeContext:
    """The running-stats guard, the module's generators' states and, if
    selective, SAC's recompute mode;
    refuses to recompute when a parameter, buffer or input the forward
    read was written since.

    Args:
        guard (RunningStatsGuard): The guard of the module's norm layers.
        generators (GeneratorStates): The module's own generators.
        modes (TrainingModes): Its modules' ``training`` flags.
        decisions (DecisionLog): The choices its forward made
            (:mod:`.recompute_decisions`), made again.
        sac_context: The recompute context of a selective policy, or a
            null context.
        inputs (list): ``(tensor, version)`` of the call's tensor inputs
            as its forward left them (:func:`watch_versions`).
        params (StateRecord): The versions of the module's parameters and
            buffers, shared by its calls (:func:`state_record`).
        generation (list): The record's generation when this call's
            forward ended (set then), and its ``switches`` when the forward
            started if that forward reads running statistics, else None.
        owner (str): The module's class and name, for the message.
    """

    def __init__(self, guard: RunningStatsGuard, generators: GeneratorStates,
                 modes: TrainingModes, decisions, sac_context, inputs: list,
                 params: 'StateRecord', generation: list, owner: str):
        self.guard, self.generators, self.modes = guard, generators, modes
        self.decisions = decisions
        self.sac_context = sac_context
        self.inputs, self.params = inputs, params
        self.generation, self.owner = generation, owner
        self._stacks: List[ExitStack] = []

    def __enter__(self) -> None:
        statistics = self.params.statistics_updated_since(self.generation[1])
        if statistics is not None:
            raise MmdtrError(
                f'activation_checkpointing: a checkpointed {self.owner} was '
                'called in eval mode, which reads the running statistics '
                f'{statistics!r}, then, before this backward, in training '
                'mode, which updated them; the recomputation of the first '
                'call would read the updated values.',
                hint='run the eval-mode call under torch.no_grad() (or after '
                'this backward), or leave that module unchecked.')
        written = written_since(self.inputs)
        changed = f'an input (shape {tuple(written.shape)})' if \
            written is not None else self.params.changed_since(
                self.generation[0])
        if changed is not None:
            # found by an adversarial search: a step in backward of a
            # parameter read through .detach() came first, and the
            # recompute silently read the new values
            raise MmdtrError(
                f'activation_checkpointing: {changed} of a checkpointed '
                f'{self.owner} was written in place or replaced between its '
                'forward and its recomputation in backward (by '
                'InplaceOptimWrapper(step_in_backward=True) stepping a '
                'parameter whose gradient was complete before, as one read '
                'through .detach(), or by code between forward and '
                "backward, such as a frozen norm's statistics recalibrated "
                'or a loss updating a buffer); the recomputation would read '
                'the new values.',
                hint='leave that module unchecked (or, if its forward does '
                'not read that tensor, checkpoint the sub-modules that do '
                'not hold it), use step_in_backward=False, or write after '
                'backward or out of place.')
        with ExitStack() as stack:  # unwound if the SAC context refuses
            stack.enter_context(self.guard)
            stack.enter_context(self.modes)
            stack.enter_context(self.generators)
            stack.enter_context(self.decisions.replaying())
            stack.enter_context(self.sac_context)
            self._stacks.append(stack.pop_all())

    def __exit__(self, *exc_info) -> None:
        self._stacks.pop().__exit__(*exc_info)
        # a later recompute (retain_graph, another call) compares with
        # this one's end
        self.inputs[:] = watch_versions(ref() for ref, _ in self.inputs)
        self.params.update()


class StateRecord:
    """The versions of a checkpointed module's parameters, and of the
    buffers its recompute reads, as its latest forward or recompute left
    them, shared by its calls.

    The buffers are all but the running statistics of the norm layers that
    update them (:func:`tracking_norms`: their recompute runs on scratch
    copies and reads batch statistics). A buffer written between the
    forward and backward (a frozen BN's statistics recalibrated, a shift
    set by a hook) was read live by the recompute: other gradients, silently
    (found by an adversarial search).

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
                running statistics (:func:`tracking_norms`).

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
