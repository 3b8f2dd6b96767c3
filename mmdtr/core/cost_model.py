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


def op_cost(func, args, kwargs, out, bytes_moved: int) -> float:
    """Estimated cost of one call, in FLOP-equivalents.

    Args:
        func: The ``OpOverload`` called.
        args (tuple): Positional arguments of the call.
        kwargs (dict): Keyword arguments of the call.
        out: What the call returned.
        bytes_moved (int): Bytes of its tensor inputs and outputs.

    Returns:
        float: FLOPs when torch.utils.flop_counter has a formula for the op,
        else ``bytes_moved * FLOPS_PER_BYTE``; at least 1.
    """
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        # Call the raw formula on shapes: flop_counter's shape_wrapper goes
        # through pytree, whose recursive closure makes a reference cycle
        # that would keep this op's tensors alive until the next GC.
        raw = getattr(formula, '__wrapped__', None)
        try:
            if raw is not None:
                flops = raw(*map(_shape, args), out_shape=_shape(out),
                            **{k: _shape(v)
                               for k, v in kwargs.items()})
            else:
                flops = formula(*args, **kwargs, out_val=out)
            return float(max(flops, 1))
        except Exception:  # a formula that cannot read this call
            pass
    return max(bytes_moved * FLOPS_PER_BYTE, 1.0)


def _shape(x):
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, (list, tuple)):
        return type(x)(_shape(y) for y in x)
    return x
