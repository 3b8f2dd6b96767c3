"""How a checkpointed call's arguments and outputs pass through
:func:`torch.utils.checkpoint.checkpoint` (torch only)."""
from typing import Callable, Optional, Tuple

import torch
from torch.utils._pytree import tree_leaves, tree_unflatten


def call_with_kwargs(forward: Callable, num_args: int, keys: Tuple[str, ...],
                     *inputs):
    """``forward`` on ``inputs``: the first ``num_args`` positionally, the
    rest by the names ``keys`` (checkpoint takes positional inputs only)."""
    args, values = inputs[:num_args], inputs[num_args:]
    return forward(*args, **dict(zip(keys, values)))


class CallerContainersFirst:
    """What :func:`checkpoint` runs, given the leaves of the call's
    arguments: the forward gets the caller's own lists and dicts (a neck
    may rebind their entries, ``feats[i] = lateral(feats[i])``, which the
    caller sees, as with the plain model); each recompute gets new ones,
    rebuilt from the leaves the forward started with (it ran on the rebound
    list: other inputs, other gradients; found by a review).

    Args:
        forward (Callable): The module's own forward.
        args (tuple): The call's positional arguments, as the caller gave
            them.
        kwargs (dict): Its keyword arguments.
        spec (TreeSpec): The structure of ``(args, kwargs)``, from
            ``tree_flatten``.
    """

    def __init__(self, forward: Callable, args: tuple, kwargs: dict, spec):
        self.forward, self.spec = forward, spec
        self.call: Optional[tuple] = (args, kwargs)  # dropped once run

    def __call__(self, *leaves):
        if self.call is not None:
            (args, kwargs), self.call = self.call, None
        else:
            args, kwargs = tree_unflatten(list(leaves), self.spec)
        return self.forward(*args, **kwargs)


def frozen_output(out) -> bool:
    """Whether no tensor of ``out`` requires grad. Unknown (no tensor found:
    a dataclass or another object pytree does not open) is not frozen: the
    checks after the forward run (found by a review)."""
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(tensors) and not any(t.requires_grad for t in tensors)
