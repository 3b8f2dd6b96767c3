"""Eviction when a CUDA allocation fails: a contiguous run that serves it.

PyTorch's caching allocator serves a request from one free block of its
pool, or from a new segment when its cap (``set_per_process_memory_fraction``,
or the card) leaves room for one; on failure it gives back the segments
that are wholly free and tries once more. Evicting storages one by one in
the policy's order frees blocks wherever they lie: next to blocks still in
use they merge with nothing, so memory is freed and the request still
fails (ResNet-50 at 224x224 on an emulated 11 GB card failed with 3.1 to
5.5 GiB reserved but free; docs/dtr.md, "CUDA").

Here the failed request's size comes from the allocator's out-of-memory
observer, the layout from its snapshot, both read only when an allocation
fails (never on the hot path, R1), and the engine evicts the candidates of
one run of adjacent blocks that, once free, is large enough: the run whose
highest policy score is lowest, then the one that frees fewest bytes (rule
R15 of docs/design.md). The planner (:func:`segments_for`,
:func:`bytes_needed`, :func:`cheapest_contiguous_run`) is pure; the rest
reads the observer, the snapshot and the allocator's settings, which
decide whether the planner's model of the allocator holds.
"""
import inspect
import math
import os
import sys
import threading
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

#: requests above this are served from the large pool (the allocator's
#: ``kSmallSize``); below it the observer reports the 2 MiB of a new small
#: segment, and nothing is planned
SMALL_SIZE = 2**20
#: what the observer reports for a request of 1 to 10 MiB (a new 20 MiB
#: segment, ``kLargeBuffer``), and for one of 18 to 20 MiB (rounded up to
#: 2 MiB, as every request of 10 MiB or more is)
LARGE_BUFFER = 20 * 2**20
MIN_LARGE_ALLOC = 10 * 2**20
#: the allocator's message for a request it could not serve
FAILED_REQUEST_TEXT = 'Tried to allocate'
_HIGHEST = sys.float_info.max  # a candidate's score of -inf becomes -this

_failures = threading.local()  # the size of this thread's last failure
_watching = []  # True once the observer is attached, False if it cannot be
_attach_lock = threading.Lock()

#: A block as the planner sees it: its size, its weight (``-inf`` free,
#: ``inf`` held, else its candidate's score) and its candidate (or None).
Block = Tuple[int, float, object]


def watch_allocation_failures() -> bool:
    """Attach, once per process, the observer that notes the size of each
    failed CUDA allocation in the thread that asked for it.

    Returns:
        bool: Whether failures are watched: not on a PyTorch build without
        the observer, nor with an allocator other than the native caching
        one (``cudaMallocAsync``, a pluggable one), which refuses it and
        whose layout the planner does not know.
    """
    with _attach_lock:
        if not _watching:
            _watching.append(_attach())
    return _watching[0]


def _attach() -> bool:
    attach = getattr(torch._C, '_cuda_attach_out_of_memory_observer', None)
    backend = getattr(torch.cuda, 'get_allocator_backend', lambda: 'native')
    if attach is None or backend() != 'native':
        return False
    try:
        attach(_note_failure)
    except RuntimeError:  # an allocator that takes no observer
        return False
    return True


def _note_failure(device, alloc_size, allowed, device_free):
    # called by the allocator in the failing thread, before it raises
    _failures.last = (int(device), int(alloc_size))


def take_failed_request(error: BaseException) -> Optional[Tuple[int, int]]:
    """``(device index, bytes reported)`` of the failed allocation that
    raised ``error``, or ``None``; forgotten once taken.

    The observer notes every failure, those something else catches too
    (cuDNN's convolutions catch their workspace's); the one noted last is
    ``error``'s when ``error`` is the allocator's own, which names the
    request, and none is taken for any other.
    """
    last = getattr(_failures, 'last', None)
    _failures.last = None
    return last if FAILED_REQUEST_TEXT in str(error) else None


#: where PyTorch reads its CUDA allocator's settings, when CUDA starts
ALLOC_CONF_VARS = ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF')


def allocator_settings(environ: Mapping[str, str] = os.environ) -> str:
    """The CUDA allocator's settings in ``environ``, lower-cased and
    without spaces (``'expandable_segments:true,...'``)."""
    return ','.join(
        environ.get(name, '').replace(' ', '').lower()
        for name in ALLOC_CONF_VARS)


def planning_applies(device: int) -> bool:
    """Whether the planner's model of the allocator holds on ``device``
    now: not while a CUDA graph is captured (a private pool serves it), nor
    with ``max_split_size_mb`` set (the allocator then refuses to split
    large free blocks, which the planner does not model)."""
    if torch.cuda.is_current_stream_capturing():
        return False
    return 'max_split_size_mb' not in allocator_settings()


_SNAPSHOT_TAKES_TRACES = 'include_traces' in inspect.signature(
    torch.cuda.memory_snapshot).parameters


def allocator_snapshot() -> Optional[list]:
    """``torch.cuda.memory_snapshot()`` without its trace entries where
    this PyTorch can leave them out, or ``None`` if it cannot be read."""
    try:
        if _SNAPSHOT_TAKES_TRACES:
            return torch.cuda.memory_snapshot(include_traces=False)
        return torch.cuda.memory_snapshot()
    except RuntimeError:
        return None


def bytes_needed(reported: int, largest_free: int) -> Optional[int]:
    """The size of a free large-pool block that serves a failed request.

    Args:
        reported (int): The size the observer reported (of the segment the
            allocator would have made).
        largest_free (int): The largest free block of the pool: the request
            is larger, or it would have been served.

    Returns:
        int | None: ``None`` for a small-pool request. A report of 20 MiB is
        a request of 1 to 10 MiB, or of 18 to 20 MiB: 20 MiB where a free
        block of 10 MiB failed to serve it, else 10 (if that does not
        serve it, the next failure finds 10 MiB free and plans for 20).
    """
    if reported <= 2 * SMALL_SIZE:
        return None
    if reported == LARGE_BUFFER and largest_free < MIN_LARGE_ALLOC:
        return MIN_LARGE_ALLOC
    return reported


def segments_for(snapshot: Sequence[dict], device: int, stream: int,
                 evictable: Dict[int, Tuple[float,
                                            object]]) -> List[List[Block]]:
    """The blocks of the segments that may serve a large request.

    Args:
        snapshot (list[dict]): ``torch.cuda.memory_snapshot()``.
        device (int): The failing allocation's device.
        stream (int): Its stream (``cuda_stream``): a block is reused on
            the stream it was allocated on only.
        evictable (dict): Address of an evictable storage -> its score and
            its record (a score of ``inf`` for an address two storages
            share: kept).

    Returns:
        list[list[Block]]: One list per segment of the device's default
        large pool on ``stream``, its blocks in address order. Expandable
        segments and private pools (CUDA graphs) are left out.
    """
    segments = []
    for segment in snapshot:
        if segment.get('device') != device or segment.get(
                'segment_type') != 'large' or segment.get(
                    'stream') != stream or segment.get('is_expandable'):
            continue
        if tuple(segment.get('segment_pool_id', (0, 0))) != (0, 0):
            continue
        blocks, address = [], segment['address']
        for block in segment['blocks']:
            address = block.get('address', address)
            size, state = block['size'], block['state']
            if state == 'inactive':
                blocks.append((size, -math.inf, None))
            elif state == 'active_allocated' and address in evictable:
                score, rec = evictable[address]
                # NaN: never evicted; -inf: the lowest, not free
                blocks.append((size, math.inf, None) if score != score else (
                    size, max(score, -_HIGHEST), rec))
            else:  # in use, or freed but awaiting another stream
                blocks.append((size, math.inf, None))
            address += size
        segments.append(blocks)
    return segments


def largest_free_block(segments: List[List[Block]]) -> int:
    """The largest free block (adjacent free blocks are merged)."""
    return max((size for blocks in segments
                for size, weight, _ in blocks if weight == -math.inf),
               default=0)


def _runs(segments: List[List[Block]], limit: float):
    """Maximal runs of adjacent blocks weighing at most ``limit``."""
    for blocks in segments:
        run = []
        for block in blocks:
            if block[1] <= limit:
                run.append(block)
            elif run:
                yield run
                run = []
        if run:
            yield run


def _fits(segments, limit, need) -> bool:
    return any(
        sum(size for size, _, _ in run) >= need
        for run in _runs(segments, limit))


def cheapest_contiguous_run(segments: List[List[Block]],
                            need: int) -> Optional[list]:
    """The candidates to evict so that ``need`` adjacent bytes are free.

    Of the runs of adjacent blocks, free or evictable, at least ``need``
    bytes long, the one whose highest score is lowest (the policy's order,
    R8), then of those the one that evicts fewest bytes.

    Args:
        segments (list[list[Block]]): From :func:`segments_for`.
        need (int): Bytes the run must span.

    Returns:
        list | None: The candidates of the run, in address order; ``None``
        when free blocks alone span ``need`` (the allocator's failure lies
        elsewhere) or no run does.
    """
    if _fits(segments, -math.inf, need):
        return None
    scores = sorted({
        weight
        for blocks in segments
        for _, weight, _ in blocks if -math.inf < weight < math.inf
    })
    if not scores or not _fits(segments, scores[-1], need):
        return None
    lo, hi = 0, len(scores) - 1  # the lowest score that fits: scores[hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(segments, scores[mid], need):
            hi = mid
        else:
            lo = mid + 1
    best, best_evicted = None, math.inf
    for run in _runs(segments, scores[hi]):
        start = spanned = evicted = 0
        for end, (size, weight, _) in enumerate(run):
            spanned += size
            evicted += size if weight > -math.inf else 0
            while spanned - run[start][0] >= need:
                first_size, first_weight, _ = run[start]
                spanned -= first_size
                evicted -= first_size if first_weight > -math.inf else 0
                start += 1
            if spanned >= need and evicted < best_evicted:
                best, best_evicted = run[start:end + 1], evicted
    return [rec for _, weight, rec in best if weight > -math.inf]
