"""The choices a checkpointed forward made, made again by its recompute.

A module that picks its path at each call (a fused trace guarded by what it
read, :class:`~mmdtr.techniques.traced_forward.GuardedForward`) could pick
another in the recompute of a checkpointed forward when something changed
between the forward and the backward (a hook added or removed, a global
module hook of ``FlopCounterMode`` around the forward only): the recompute
then saves another number of tensors, and ``torch.utils.checkpoint``
raises (found by a review). So the forward records each choice made inside
it, in call order (a nested checkpoint's choices in the enclosing log too),
and the recompute takes them again, in order; a choice beyond those
recorded is made afresh. Per thread: a recompute runs on the
thread of the backward that needs it, choices and all.
"""
import threading
from contextlib import contextmanager
from typing import Callable, List

_LOCAL = threading.local()  # .stack: [(DecisionLog, iterator or None)]


class DecisionLog:
    """The choices made inside one checkpointed call's forward."""

    def __init__(self):
        self.decisions: List[bool] = []

    @contextmanager
    def recording(self):
        """The forward: choices made inside are appended."""
        with _pushed(self, None):
            yield

    @contextmanager
    def replaying(self):
        """A recompute: choices are taken again, in order (each recompute
        from the first: ``retain_graph`` recomputes again)."""
        with _pushed(self, iter(self.decisions)):
            yield


@contextmanager
def _pushed(log: DecisionLog, replay):
    stack = getattr(_LOCAL, 'stack', None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append((log, replay))
    try:
        yield
    finally:
        stack.pop()


def decide(choose: Callable[[], bool]) -> bool:
    """``choose()``, or inside a recompute the choice its forward made.

    Args:
        choose (Callable[[], bool]): Makes the choice now.

    Returns:
        bool: The choice.
    """
    stack = getattr(_LOCAL, 'stack', None)
    if not stack:
        return choose()
    # the innermost recompute replays; the forwards started inside it (a
    # checkpoint nested in the recomputed one) and, outside any, every
    # forward recording, get the choice too: an outer checkpoint's
    # recompute runs the inner one's forward again, which must choose as
    # in the outer forward (found by a review)
    replaying = next(
        (i for i in range(len(stack) - 1, -1, -1) if stack[i][1] is not None),
        -1)
    made = next(stack[replaying][1], None) if replaying >= 0 else None
    if made is None:
        made = choose()
    for log, replay in stack[replaying + 1:]:
        log.decisions.append(made)
    return made
