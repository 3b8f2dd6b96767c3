"""What a rebuild keeps of what it rebuilt, and for how many reads (R4).

A rebuild keeps each storage it rebuilt for the reads of it still to come
in that rebuild (``EngineState.rebuilt`` maps ``(record, version)`` to
``[storage, reads left]``), and lets it go at the last; what cannot be
counted is kept until the outermost rebuild ends. The replay half of the
engine (:mod:`mmdtr.core.replay`) asks these functions.
"""
import sys

from .recipe_refs import RecordRef

#: What :func:`reads_in_a_rebuild` returns when the reads cannot be
#: counted: a rebuild keeps the storage until it ends (R4).
UNCOUNTED_READS = sys.maxsize


def reads_in_a_rebuild(rec) -> int:
    """How many times a rebuild may read ``rec``: one per recipe argument
    of a live record that reads it (``users`` holds one entry per such
    argument; a record reading it twice counts twice), or
    :data:`UNCOUNTED_READS` when such a record may be rebuilt more than
    once in one rebuild, each time replaying its creator: written in place
    since and read at two or more versions, or stale (written where the
    engine did not see it, after the scope closed or by another thread, or
    shrunk below the dispatcher, R13: rebuilt for each read). All found by
    reviews. Arguments of recipes dropped since count too, so it is never
    below the reads a rebuild makes (R4); readers frozen by a write to it
    are no longer listed, and read it no more (R7)."""
    reads = 0
    # a copy: a collection inside the loop may prune the list (R12)
    for ref in tuple(rec.users or ()):
        user = ref()
        if user is None:
            continue
        # stale: written unseen (None while not resident) or shrunk below
        # the dispatcher (R13)
        if user.mutations and _versions_read(user) > 1 or \
                user.written_unseen() is not None or \
                shrank(user, user.storage()):
            return UNCOUNTED_READS
        reads += 1
    return reads


def _versions_read(rec) -> int:
    """How many versions of ``rec`` recipes of live records read, with the
    one its saved handles read."""
    versions = {rec.version} if rec.handles else set()
    for ref in tuple(rec.users or ()):  # a copy, as above
        user = ref()
        if user is None:
            continue
        for node in (user.creator, *user.mutations):
            for arg in node.refs() if node is not None else ():
                if type(arg) is RecordRef and arg.record is rec:
                    versions.add(arg.version)
    return len(versions)


def shrank(rec, storage) -> bool:
    """Whether ``storage``, ``rec``'s live one or ``None``, shrank below
    the dispatcher (a seen resize updates ``nbytes``; a grown storage
    keeps its bytes): then each read of ``rec`` rebuilds it (R13)."""
    return storage is not None and storage.nbytes() < rec.nbytes


def read_once(memo, key):
    """The storage a rebuild keeps for ``key``, or ``None``; counts one of
    its reads, and lets it go after the last (R4)."""
    entry = memo.get(key)
    if entry is None:
        return None
    entry[1] -= 1
    if entry[1] <= 0:
        del memo[key]
    return entry[0]
