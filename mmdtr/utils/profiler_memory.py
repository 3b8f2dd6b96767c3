"""Measure the memory a call allocates, from the profiler's memory events.

:func:`measure_peak_memory` runs a callable under
``torch.profiler.profile(activities=[CPU], profile_memory=True)``. With
``profile_memory`` on, every allocation and free of the device allocators is
recorded as an allocation event carrying its address and signed byte delta
(``+n`` on allocation, ``-n`` on free), read from the profiler's event
tree. Summing the deltas in time order, starting from
0 when the call starts, gives the live bytes the call added at every moment;
the peak is the maximum of that running sum. Only frees of blocks allocated
during the call count: the profiler cannot size a block allocated before
any session started (PyTorch warns once and reports no free), but it does
report the free of a block an earlier session allocated, which lowered the
count (a second measurement read a peak of 0; found by an adversarial
search), so frees are matched to the call's allocations by address. The
peak is that of the bytes allocated during the call and still live. The
result is exact in bytes for the CPU allocator (which reports requested
sizes) and independent of any meter under test.

The profiler cannot be nested: :func:`measure_memory` refuses to run while
another ``torch.profiler`` session is active on its thread (a nested session
empties the outer one's events). A session in another thread is not seen
(PyTorch crashes on that): do not measure while one runs.
"""
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

from mmdtr.errors import MmdtrError

#: The profiler's event type of allocations and frees.
_ALLOCATION = torch._C._profiler._EventType.Allocation


@dataclass
class MemoryMeasurement:
    """What :func:`measure_memory` observed during one call.

    Args:
        result (Any): The callable's return value.
        peak_bytes (int): Highest live bytes allocated during the call
            (at least 0).
        end_bytes (int): Bytes allocated during the call still live when it
            returned.
        allocated_bytes (int): Sum of all allocations during the call.
        freed_bytes (int): Sum of the frees during the call of blocks it
            allocated (positive).
        deltas (list[int]): The signed byte deltas in time order.
    """

    result: Any
    peak_bytes: int
    end_bytes: int
    allocated_bytes: int
    freed_bytes: int
    deltas: List[int] = field(default_factory=list, repr=False)


def _checked_device_type(device_type) -> str:
    """``'cpu'`` or ``'cuda'`` (a ``torch.device`` of those types too);
    anything else counted nothing, silently (an adversarial search)."""
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    if device_type not in ('cpu', 'cuda'):
        raise MmdtrError(
            f'device_type={device_type!r} is not accepted; accepted: '
            "'cpu' or 'cuda' (the allocator whose events are counted).",
            hint="e.g. measure_memory(step, device_type='cuda').")
    return device_type


def memory_deltas(prof: profile, device_type: str = 'cpu') -> List[int]:
    """Return the signed byte deltas of a finished profile, in time order.

    Args:
        prof (torch.profiler.profile): A profile run with
            ``profile_memory=True`` that has exited.
        device_type (str): ``'cpu'`` or ``'cuda'`` (the allocator whose
            events are kept). Defaults to ``'cpu'``.

    Returns:
        list[int]: ``+n`` per allocation of ``n`` bytes, ``-n`` per free of
        a block allocated during the profile, sorted by timestamp (stable,
        so same-time events keep record order).
    """
    device_type = _checked_device_type(device_type)
    events = []  # (time, size, address) of the allocations and frees
    stack = list(
        reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # depth first, in record order
        node = stack.pop()
        stack.extend(reversed(node.children))
        kind, fields = node.typed
        if kind == _ALLOCATION and fields.device.type == device_type:
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
    events.sort(key=lambda event: event[0])  # stable: same-time in order
    deltas, allocated = [], set()
    for _, size, address in events:
        if size >= 0:
            allocated.add(address)
        elif address in allocated:
            allocated.discard(address)
        else:  # allocated before the call
            continue
        deltas.append(int(size))
    return deltas


def measure_memory(fn: Callable,
                   args: tuple = (),
                   kwargs: Optional[dict] = None,
                   device_type: str = 'cpu') -> MemoryMeasurement:
    """Run ``fn(*args, **kwargs)`` under the profiler and measure memory.

    Args:
        fn (Callable): The call to measure.
        args (tuple): Positional arguments of ``fn``.
        kwargs (dict, optional): Keyword arguments of ``fn``.
        device_type (str): Allocator to count, ``'cpu'`` (default) or
            ``'cuda'``.

    Returns:
        MemoryMeasurement: The result of ``fn`` and the byte counts.

    Raises:
        MmdtrError: If ``device_type`` is not ``'cpu'`` or ``'cuda'``, or
            another profiler session is active.

    Examples:
        >>> m = measure_memory(torch.zeros, (1024, ))
        >>> m.peak_bytes, m.end_bytes
        (4096, 4096)
    """
    kwargs = kwargs or {}
    device_type = _checked_device_type(device_type)
    if torch.autograd._profiler_enabled():
        raise MmdtrError(
            'measure_memory runs its own torch.profiler session, and one is '
            'active: the profiler cannot be nested.',
            hint='measure outside the other profiler session.')
    with profile(
            activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    deltas = memory_deltas(prof, device_type)
    live = peak = 0
    for delta in deltas:
        live += delta
        peak = max(peak, live)
    return MemoryMeasurement(
        result=result,
        peak_bytes=peak,
        end_bytes=live,
        allocated_bytes=sum(d for d in deltas if d > 0),
        freed_bytes=-sum(d for d in deltas if d < 0),
        deltas=deltas)


def measure_peak_memory(fn: Callable, *args, **kwargs) -> Tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` and return its result and peak CPU bytes.

    The peak counts from 0 at the start of the call: the most bytes the
    call had allocated and not yet freed at any moment (what it returns
    included). See :func:`measure_memory` for more figures and CUDA.

    Args:
        fn (Callable): The call to measure.
        *args: Positional arguments of ``fn``.
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        tuple: ``(result, peak_bytes)``.

    Examples:
        >>> def step():
        ...     loss = model(inputs).sum()
        ...     loss.backward()
        >>> _, peak = measure_peak_memory(step)
    """
    measured = measure_memory(fn, args, kwargs)
    return measured.result, measured.peak_bytes
