"""Python's cyclic garbage collector runs less often while engines are active.

An engine makes a few Python objects per op (records, recipes, weak
references), alive until backward frees them. Python's collector counts
them: every 700 allocations a young collection walks the young objects,
survivors are promoted, and every few steps a full collection walks every
object of the process (a few hundred thousand in a training process; 130
to 300 ms on this project's 2-core CPU, where a step of ResNet-50 on an
H100 takes 38 ms). So while an engine is active the first generation's
threshold is raised to :data:`YOUNG_THRESHOLD` (rule R1 of
docs/design.md): the objects of a step are mostly freed by their reference
counts before a collection sees them, and cycles are still collected, a
bounded number of allocations later. ``gc.collect()`` collects at once, as
always.
"""
import gc
import threading

#: the first generation's threshold while an engine is active (Python's
#: default is 700): a young collection every 100,000 net allocations
YOUNG_THRESHOLD = 100_000

_lock = threading.Lock()
_active = 0  # engines active, in every thread
_saved = None  # the first generation's threshold that was raised


def space_collections() -> None:
    """An engine becomes active: the first one raises the threshold of the
    first generation to :data:`YOUNG_THRESHOLD`, unless it is higher already
    or automatic collection is off (threshold 0)."""
    global _active, _saved
    with _lock:
        _active += 1
        if _active > 1:
            return
        threshold = gc.get_threshold()
        if 0 < threshold[0] < YOUNG_THRESHOLD:
            _saved = threshold[0]
            gc.set_threshold(YOUNG_THRESHOLD, *threshold[1:])


def restore_collections() -> None:
    """An engine closes: the last one puts the threshold back, unless
    someone set another meanwhile (theirs is kept)."""
    global _active, _saved
    with _lock:
        _active -= 1
        if _active > 0 or _saved is None:
            return
        threshold = gc.get_threshold()
        if threshold[0] == YOUNG_THRESHOLD:
            gc.set_threshold(_saved, *threshold[1:])
        _saved = None
