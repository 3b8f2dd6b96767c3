"""A device-agnostic cost of an op: FLOPs, or bytes moved.

Compute-heavy ops are costed with ``torch.utils.flop_counter``'s formulas;
every other op by the bytes it reads and writes, times
:data:`FLOPS_PER_BYTE`. No timer is read, so nothing synchronizes the device
(rule R9 of docs/design.md).
"""
import torch
from torch.utils.flop_counter import flop_registry

#: Exchange rate between a byte moved and a FLOP: a memory-bound op moving
#: N bytes is costed like N * FLOPS_PER_BYTE FLOPs. Roughly the ratio of
#: compute throughput to memory bandwidth of current hardware.
FLOPS_PER_BYTE = 8.0


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes addressed by a tensor's elements."""
    return t.numel() * t.element_size()


def tensors_bytes(values) -> int:
    """Bytes addressed by the tensors among ``values``, in lists and tuples
    nested at any depth; anything else counts nothing."""
    total = 0
    for a in values:
        if isinstance(a, torch.Tensor):
            total += tensor_bytes(a)
        elif isinstance(a, (list, tuple)):
            total += tensors_bytes(a)
    return total


def op_cost(func, args, kwargs, out) -> float:
    """Estimated cost of one call, in FLOP-equivalents.

    Args:
        func: The ``OpOverload`` called.
        args (tuple): Positional arguments of the call.
        kwargs (dict): Keyword arguments of the call.
        out: What the call returned.

    Returns:
        float: FLOPs when torch.utils.flop_counter has a formula for the op,
        else the bytes of its tensor inputs and outputs times
        ``FLOPS_PER_BYTE``; at least 1.
    """
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        # Call the raw formula on shapes: flop_counter's shape_wrapper goes
        # through pytree, whose recursive closure makes a reference cycle
        # that would keep this op's tensors alive until the next GC.
        raw = getattr(formula, '__wrapped__', None)
        try:
            if raw is not None:
                flops = raw(
                    *[_shape(a) for a in args],
                    out_shape=_shape(out),
                    **{
                        k: _shape(v)
                        for k, v in kwargs.items()
                    })
            else:
                flops = formula(*args, **kwargs, out_val=out)
            return float(max(flops, 1))
        except Exception:  # a formula that cannot read this call
            pass
    moved = tensors_bytes((*args, *kwargs.values())) + tensors_bytes(
        out if isinstance(out, (tuple, list)) else (out, ))
    return max(moved * FLOPS_PER_BYTE, 1.0)


def _shape(x):
    """``x`` with tensors replaced by their shapes (one list level)."""
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                return type(x)([_shape(z) for z in x])
    return x
