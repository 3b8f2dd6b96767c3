"""Python's full garbage collections are rarer while engines are active.

An engine makes a few Python objects per op (records, recipes, weak
references), alive until backward frees them. Python's collector counts
them: every 700 allocations a young collection walks the young objects,
every 10 of those a middle one, and every 10 of these (when enough objects
were promoted since) a full collection walks every object of the process:
a few hundred thousand in a training process, 130 to 300 ms on this
project's 2-core CPU, where a step of ResNet-50 on an H100 takes 38 ms.
So while an engine is active the third threshold is
:data:`FULL_THRESHOLD` (rule R1 of docs/design.md): young and middle
collections run as before, so a cycle made in scope is collected as soon
as without DTR unless it outlived two of them, and then at a full
collection, up to ten times later. ``gc.collect()`` collects at once, as
always.
"""
import gc
import threading
import weakref

#: the full collections' threshold while an engine is active (Python's
#: default is 10): one is considered every 100 middle collections
FULL_THRESHOLD = 100

_lock = threading.Lock()
_active = 0  # engines active, in every thread
_saved = None  # the threshold that was raised


def space_collections(engine) -> weakref.finalize:
    """``engine`` becomes active: the first one raises the full
    collections' threshold to :data:`FULL_THRESHOLD`, unless it is higher
    already or automatic collection is off.

    Returns:
        weakref.finalize: Call it when ``engine`` closes. It also runs if
        ``engine`` is dropped without closing (a thread that ended under
        ``dtr.enable()``), so the threshold is put back all the same.
    """
    global _active, _saved
    with _lock:
        _active += 1
        if _active == 1:
            threshold = gc.get_threshold()
            if threshold[0] > 0 and 0 < threshold[2] < FULL_THRESHOLD:
                _saved = threshold[2]
                gc.set_threshold(threshold[0], threshold[1], FULL_THRESHOLD)
    return weakref.finalize(engine, _restore_collections)


def _restore_collections() -> None:
    """An engine closed: the last one puts the threshold back, unless
    someone set another meanwhile (theirs is kept)."""
    global _active, _saved
    with _lock:
        _active -= 1
        if _active > 0 or _saved is None:
            return
        threshold = gc.get_threshold()
        if threshold[2] == FULL_THRESHOLD:
            gc.set_threshold(threshold[0], threshold[1], _saved)
        _saved = None


def active_engines() -> int:
    """Engines active in the process, as counted here (for tests)."""
    return _active
