"""The references a recipe holds in place of its tensor arguments: how
each input of a recorded call is got back at the version the call read
(rules R4, R5 and R13 of docs/design.md).
"""


class RecordRef:
    """An input read from a recorded storage at ``version``."""
    __slots__ = ('record', 'version', 'meta')

    def __init__(self, record, version, meta):
        self.record, self.version, self.meta = record, version, meta


class HeldRef:
    """An input the engine holds on to: external, or not recomputable.

    ``version`` is checked on replay against the record's version (storages
    allocated in scope) or the tensor's ``_version``: an external leaf is
    held as itself; an external non-leaf is held as an alias without
    autograd history (no reference cycle through its ``grad_fn``, R10)
    that shares its counter, read through ``wrefs`` (weak references to the
    tensor, and to its base if it is a view) while one of them lives and
    still views the held storage, and through the alias once all are gone
    (R13); a view of a leaf (``w.t()``) keeps the leaf (``leaf``: no
    cycle), so its counter stays readable and the alias, whose counter is
    never read, is a plain detached one (cheaper). ``None`` skips the
    check (inference tensors). ``cdata``, for external leaves, is the
    storage they had: ``leaf.data = other`` swaps it without a version
    bump. ``tracked``: the tensors ops in scope returned over the storage
    (:class:`~mmdtr.core.tracked_tensors.UnrecordedTensors`).
    """
    __slots__ = ('tensor', 'record', 'version', 'cdata', 'wrefs', 'tracked',
                 'leaf')

    def __init__(self,
                 tensor,
                 record,
                 version,
                 cdata=None,
                 wrefs=None,
                 tracked=None,
                 leaf=None):
        self.tensor, self.record, self.version = tensor, record, version
        self.cdata, self.wrefs, self.tracked = cdata, wrefs, tracked
        self.leaf = leaf

    def current_version(self):
        if self.record is not None:
            return self.record.version
        if self.version is None:
            return None
        if self.wrefs is None:
            return self.tensor._version
        held = self.tensor.untyped_storage()._cdata
        # the view first: a temporary one is gone by backward, its base
        # lives; one moved to another storage (.data =, set_) is not read
        moved = False
        for ref in self.wrefs:
            t = ref()
            if t is not None:
                if t.untyped_storage()._cdata == held:
                    return t._version
                moved = True
        # all gone: the alias's counter, which a detached alias or view of
        # theirs still moves (found by an adversarial review); one moved
        # to another storage is trusted (its writes go there)
        return self.version if moved else self.tensor._version


class SelfRef:
    """In a mutation node: a view of the storage being rebuilt."""
    __slots__ = ('meta', )

    def __init__(self, meta):
        self.meta = meta


class ScratchRef:
    """An argument the op writes as a side effect; replay gets a copy."""
    __slots__ = ('tensor', )

    def __init__(self, tensor):
        self.tensor = tensor
