"""What a replayed call runs under, as it was recorded (R4, R6 of
docs/design.md): the default dtype of the call, outside functorch's and
the legacy vmap's transforms, and copies blocking. Each puts back what it
changed, through an interrupt too (:mod:`.interrupts`).
"""
import torch

from .interrupts import interrupt_safe, put_back

#: the key under which torch.func's vmap refuses (or batches) random ops
VMAP_MODE = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchVmapMode)

#: copies that take ``non_blocking``, and its place among their arguments
NON_BLOCKING_COPIES = {
    torch.ops.aten._to_copy.default: None,
    torch.ops.aten.copy_.default: 2,
}


@interrupt_safe
def recorded_default_dtype(dtype):
    """The default dtype as it was when the call was recorded (R4); set
    only when it changed since, which is rare (it is process-wide)."""
    now = torch.get_default_dtype()
    if now is dtype:
        yield
        return
    try:  # an interrupt right after the set is inside: put back
        torch.set_default_dtype(dtype)
        yield
    finally:
        put_back(lambda: torch.set_default_dtype(now))


@interrupt_safe
def outside_vmap():
    """Run a rebuild outside functorch's transforms and the legacy vmap
    of autograd's ``is_grads_batched`` (and vectorized jacobians): a
    backward under either would refuse a replayed random op, or batch it;
    a replay reads plain tensors only (R6)."""
    left = 0  # legacy levels let go, each counted first: an interrupt is
    # raised after a call returns, so the count stays true (interrupts.py)
    try:
        try:
            level = torch._C._vmapmode_increment_nesting() - 1
        finally:
            torch._C._vmapmode_decrement_nesting()
        while left < level:  # the legacy mode has no exclusion guard
            left += 1
            torch._C._vmapmode_decrement_nesting()
        with torch._C._DisableFuncTorch(), \
                torch._C._ExcludeDispatchKeyGuard(VMAP_MODE):
            yield
    finally:

        def restore():
            nonlocal left
            while left:
                left -= 1
                torch._C._vmapmode_increment_nesting()

        put_back(restore)


def blocking(func, args, kwargs):
    """A copy's arguments with ``non_blocking`` off: a rebuilt tensor is
    read as soon as its rebuild returns, so a device-to-host copy must have
    landed by then (the recorded call's reader may have synchronized
    first; found by a review of the CUDA paths). Same bits either way."""
    if kwargs.get('non_blocking'):
        kwargs = dict(kwargs, non_blocking=False)
    at = NON_BLOCKING_COPIES[func]
    if at is not None and len(args) > at and args[at]:
        args = args[:at] + (False, ) + args[at + 1:]
    return args, kwargs
