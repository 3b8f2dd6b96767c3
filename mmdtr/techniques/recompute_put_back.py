"""What a checkpointed module's recompute puts back as its forward had it.

The recompute runs the module's forward again during the backward: by
then its modules may have been switched between ``train()`` and ``eval()``
(:class:`TrainingModes`), and the generators it draws from have moved on
(:class:`GeneratorStates`). Each is set back for the recompute, and after
it to what the recompute found.
"""
import itertools
from typing import List

import torch
import torch.nn as nn

_CONTAINERS = (list, tuple, dict)


class _PutBack:
    """Re-entrant: for the recompute, put each object's value back as the
    forward found it (``recorded``), and after it as the recompute found it.
    Subclasses say how a value is read and written."""

    def __init__(self, recorded: list):
        self.recorded = recorded  # [(object, value at the forward)]
        self._stack: List[list] = []

    def __enter__(self):
        self._stack.append([(o, self.read(o)) for o, _ in self.recorded])
        for o, value in self.recorded:
            self.write(o, value)
        return self

    def __exit__(self, *exc_info) -> None:
        for o, value in self._stack.pop():
            self.write(o, value)


class TrainingModes(_PutBack):
    """During the recompute, put every module's ``training`` flag back as
    the forward found it, and after it as the recompute found it.

    A module switched between ``train()`` and ``eval()`` between a
    checkpointed forward and its backward (plain autograd does not mind)
    recomputed in the other mode: batch norm normalized otherwise and, from
    eval to train, updated the real running statistics before torch's
    checkpoint refused the other tensors (found by an adversarial search).

    Args:
        module (nn.Module): The checkpointed module, at its forward's start.
    """

    def __init__(self, module: nn.Module):
        super().__init__([(m, m.training) for m in module.modules()])

    @staticmethod
    def read(module: nn.Module) -> bool:
        """Read a module's ``training`` flag.

        Args:
            module (nn.Module): The module.

        Returns:
            bool: Its ``training`` flag.
        """
        return module.training

    @staticmethod
    def write(module: nn.Module, training: bool) -> None:
        """Set a module's ``training`` flag (on it alone, not its children).

        Args:
            module (nn.Module): The module.
            training (bool): The flag to set.
        """
        module.training = training


class GeneratorStates(_PutBack):
    """During the recompute, put the module's own ``torch.Generator`` s
    back to their states at the forward's start; after it, where the
    recompute found them.

    ``torch.utils.checkpoint`` restores only the default generators, so a
    module drawing from a generator it holds (``self.gen``) drew the next
    numbers in the recompute, and advanced the generator a second time
    (found by an adversarial search). Re-entrant, as
    :class:`RunningStatsGuard`.

    Args:
        module (nn.Module): The checkpointed module, at its forward's start:
            the generators held as attributes by it and its descendants
            are read then.
        arguments (list): The leaves of the call's arguments: generators
            passed (``block(x, gen=g)``) count too (found by a review).
    """

    def __init__(self, module: nn.Module, arguments: list):
        generators = {}
        # ``type(v) is``: isinstance goes through torch.Generator's Python
        # metaclass, 10x the cost on every attribute (found by a review);
        # lists, tuples and dicts one level down (``self.gens = [g]``;
        # found by an adversarial search)
        for value in itertools.chain(
                arguments, *(vars(m).values() for m in module.modules())):
            if type(value) in _CONTAINERS:
                items = value.values() if type(value) is dict else value
                for item in items:
                    if type(item) is torch.Generator:
                        generators[id(item)] = item
            elif type(value) is torch.Generator:
                generators[id(value)] = value
        super().__init__([(g, g.get_state()) for g in generators.values()])

    @staticmethod
    def read(generator: torch.Generator) -> torch.Tensor:
        """Read a generator's state.

        Args:
            generator (torch.Generator): The generator.

        Returns:
            Tensor: ``generator.get_state()``.
        """
        return generator.get_state()

    @staticmethod
    def write(generator: torch.Generator, state: torch.Tensor) -> None:
        """Set a generator's state.

        Args:
            generator (torch.Generator): The generator.
            state (Tensor): A state from :meth:`read`.
        """
        generator.set_state(state)
