"""What a checkpointed module's recompute may not change a second time.

Activation checkpointing runs a module's forward twice: once in the
forward pass and once, to rebuild its activations, during the backward.
Whatever that forward writes besides its outputs is written twice:

- the running statistics of normalization layers in training mode: the
  recompute writes into throw-away copies (:class:`RunningStatsGuard`), since
  their outputs do not depend on them;
- any other buffer (an EMA, a call counter): the recompute would read the
  updated value, so its activations and gradients would differ; it is
  refused (:meth:`~.module_state_record.StateRecord.written_buffer`).

And what the recompute reads must not have changed since the forward: a
parameter or input written in place in between is refused when backward
would recompute (:class:`RecomputeContext`). What the recompute puts back
as its forward had it (generators, train/eval modes) is in
:mod:`.recompute_put_back`.
"""
import weakref
from contextlib import ExitStack
from typing import TYPE_CHECKING, List, Optional

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _NormBase

from mmdtr.errors import MmdtrError
from .recompute_put_back import GeneratorStates, TrainingModes

if TYPE_CHECKING:
    from .module_state_record import StateRecord

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
            buffers, shared by its calls
            (:func:`~.module_state_record.state_record`).
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
