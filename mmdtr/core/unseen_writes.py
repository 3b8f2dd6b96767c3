"""What a replay checks of the tensors it reads for writes and frees the
engine did not see (R13 of docs/design.md): a tensor written in place
after the scope closed, by another thread, or by a kernel outside the
dispatcher; a storage resized below the dispatcher. The version a recipe
read is then rebuilt from its own recipe, or the replay is refused.
"""
import torch

from mmdtr.errors import MmdtrError
from .records import _PLAIN, view_meta


def unseen_write(shape, before, now) -> MmdtrError:
    """The error for a tensor of ``shape`` whose version counter moved
    from ``before`` to ``now`` where the engine did not see it."""
    return MmdtrError(
        f'a tensor of shape {tuple(shape)} that DTR may recompute from was '
        f'written in place where the engine could not see it (version '
        f'{before} -> {now}): after the DTR scope closed and before backward,'
        ' by another thread while it was open, or by a kernel outside the '
        'dispatcher. A recomputation would read the new values (R13).',
        'run backward inside the DTR scope (DTRHook does), write into a '
        'copy (t = t.clone()) once the scope has closed, and write the '
        "scope's tensors from its own thread.")


def reach(meta) -> int:
    """Bytes of its storage a view with ``meta`` (see ``view_meta``) reads,
    from the storage's start."""
    dtype, shape, stride, offset = meta
    if 0 in shape:
        return 0
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
    return (last + 1) * dtype.itemsize


def shrunk(t) -> bool:
    """Whether a plain strided tensor's storage no longer covers its view
    (other tensors have no storage to read it from, or no strides)."""
    if type(t) not in _PLAIN or t.layout is not torch.strided \
            or t.is_nested or t.is_meta or t.is_quantized:
        return False  # quint4x2 packs two values a byte: no itemsize
    return t.untyped_storage().nbytes() < reach(view_meta(t))


def shrunk_unseen(what: str, nbytes, reads) -> MmdtrError:
    """The error for ``what``, whose storage of ``nbytes`` bytes no longer
    covers the ``reads`` bytes it reads."""
    return MmdtrError(
        f'{what} that DTR needs to recompute from has lost memory where the '
        f'engine could not see it: its storage has {nbytes} bytes and the '
        f'tensor reads {reads} '
        '(untyped_storage().resize_(), as FSDP frees parameters, runs '
        'below the dispatcher). Reading it would read freed memory.',
        'free it after backward, or restore its size and contents before '
        'backward (R13).')


def stale_after_unseen_write(rec, rebuildable):
    """Whether a tensor over resident ``rec`` was written where the engine
    did not see it (R13): after the scope closed, or, in scope, by another
    thread (or so its counter says: one shared with a tensor moved to
    another storage moves with writes there). Then a recipe must not read
    it as it is: the version it read is rebuilt from its own recipe, exact
    either way. Raises if that cannot be (``rebuildable`` False, or outside
    ``lo..hi``)."""
    written = rec.written_unseen()  # None while evicted
    if written is None:
        return False
    if rebuildable and rec.recomputable(rec.version):
        return True
    t, before = written
    raise unseen_write(t.shape, before, t._version)
