"""The records: one per storage.

A :class:`StorageRecord` is MegEngine's tensor record at storage
granularity (rule R2 of docs/design.md): its producer (``creator``, an
``OpNode`` of :mod:`mmdtr.core.recipes`) and the in-place writes applied
since (``mutations``), its size, its recompute cost and the bookkeeping the
policy reads; DTR's evicted equivalence classes link records (R8).
"""
import weakref

import torch

from .tracked_tensors import TrackedTensors, WeakList


def view_meta(t: torch.Tensor) -> tuple:
    """What rebuilds a tensor from its storage: dtype, size, stride, offset.
    """
    return (t.dtype, t.shape, t.stride(), t.storage_offset())


def view_of(storage, meta: tuple, device) -> torch.Tensor:
    """A tensor over ``storage`` with the view described by ``meta``."""
    with torch._C._DisableTorchDispatch():
        return torch.empty(
            0, dtype=meta[0], device=device).set_(storage, meta[3], meta[1],
                                                  meta[2])


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def managed(t: torch.Tensor) -> bool:
    """Whether the engine may record and evict ``t``'s storage: a plain
    tensor (a subclass's type would be lost), strided, not nested (no
    strides to rebuild a view from), not quantized, not a zero tensor
    (forward AD's efficient zeros: a size but no data), and without a
    conjugate or negative bit (a rebuilt view carries neither bits nor a
    quantizer or the zero bit); other tensors are held (R4)."""
    return type(t) in _PLAIN and t.layout is torch.strided and not (
        t.is_nested or t.is_quantized or t.is_conj() or t.is_neg()
        or t._is_zerotensor())


def detached_alias(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` without autograd history (no reference cycles)."""
    with torch._C._DisableTorchDispatch():
        return t.detach()


def counter_sharing_alias(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` without autograd history that shares its version
    counter, as ``t.detach()`` above the dispatcher does: a write through
    any tensor sharing ``t``'s counter (its views, its detached aliases)
    shows in the alias after ``t`` is gone (R13). Below autograd (in an
    op's dispatch) ``detach`` gets a fresh counter; ``ADInplaceOrView``,
    let through here, is what shares it. Holds no reference to ``t`` or its
    ``grad_fn`` (no cycles, R10)."""
    with torch._C._DisableTorchDispatch():  # read inside: no mode sees it
        include = torch._C._dispatch_tls_local_include_set()
        exclude = torch._C._dispatch_tls_local_exclude_set().remove(
            torch._C.DispatchKey.ADInplaceOrView)
        with torch._C._ForceDispatchKeyGuard(include, exclude):
            return t.detach()


class StorageRef(weakref.ref):
    """A weak reference to a storage that remembers its StorageImpl pointer
    (``cdata``) and size, once indexed (R14) its device and where its
    memory starts (its data address), and for a storage an op made before
    recording started a weak reference to the tensor it returned
    (``maker``, R16; unset otherwise)."""
    __slots__ = ('cdata', 'nbytes', 'device', 'start', 'maker')


#: Classes that more storages than this have joined (those rebuilt since
#: count too) are not split when a member is rebuilt, only their cost
#: drops: re-forming one costs time linear in it, on every rebuild (R8).
SPLIT_AT_MOST = 128


class EvictedClass:
    """A union-find node of DTR's evicted equivalence classes.

    A root knows its members through weak references (a strong record ->
    class -> record path would be a reference cycle, freed only by the
    garbage collector), so that a rematerialization can split its class.

    Args:
        record (StorageRecord): The first member.
    """
    __slots__ = ('parent', 'cost', 'members')

    def __init__(self, record):
        self.parent, self.cost = None, record.cost
        self.members = [weakref.ref(record)]

    def root(self):
        root = self
        while root.parent is not None:
            root = root.parent
        node = self
        while node is not root and node.parent is not root:
            node.parent, node = root, node.parent  # path compression
        return root

    def merge(self, other):
        """Union of two roots; returns the surviving root."""
        if len(self.members) < len(other.members):
            self, other = other, self
        other.parent = self
        self.cost += other.cost
        self.members += other.members
        other.members = None
        return self


class StorageRecord(TrackedTensors):
    """The engine's record of one storage allocated while it is active.

    Attributes:
        nbytes (int): Size of the storage.
        device (torch.device): Where it lives.
        cdata (int | None): StorageImpl pointer (``_cdata``) of the live
            storage (key of the engine's table), ``None`` while it is not
            resident.
        wref (weakref.ref | None): Weak reference to the live storage.
        views (dict): The engine's own aliases, keyed by view meta, and
            by ``None`` for the alias of the whole storage a rebuild makes;
            they keep a saved storage resident (rule R3).
        handles (int): Saved-tensor handles pointing at this record.
        creator (OpNode | AllocNode | None): The producing call.
        out_index (int): Which output of ``creator`` this storage is.
        base (int): Version the creator's output has.
        mutations (list | tuple): In-place writes; ``mutations[i]`` makes
            version ``base + i + 1`` (an empty tuple until the first).
        version (int): Current version (number of writes seen).
        lo (int | None), hi (int | None): Versions ``lo..hi`` can be
            recomputed; ``lo is None``: none can; ``hi is None``: no bound.
        cost (float): Cost of the creator and the writes.
        last_access (int): Clock of the last use.
        remat_count (int): Times recomputed.
        users (WeakList | None): Weak references to the records whose
            recipes read this one; ``None`` until the first.
        inputs (list | tuple): Records this one's recipe reads (an empty
            tuple until the first).
        keepalive: A strong reference to the storage of a frozen record.
        alias_refs (dict | None): View meta -> weak reference to the alias
            made at a save (it shares the saved tensor's version counter),
            while it is in ``views`` (R10).
        born (int): Clock when the storage was registered.
        recipe_nbytes (int): Size of the storage the recipe rebuilds (a
            later ``resize_`` grows ``nbytes`` only).
        tensors (TensorRefs | None): Weak references to the tensors ops in
            scope returned over this storage, the user's among them (R13).
        exit_versions (tuple | None): ``(weak reference, version)`` of
            those alive when the scope closed (R13).
        synced (tuple | None): The same, in scope, noted when a recipe
            read the storage as it is after the last write the engine saw
            (R13: a write from another thread is not seen).
    """
    __slots__ = ('nbytes', 'device', 'cdata', 'wref', 'views', 'handles',
                 'creator', 'out_index', 'base', 'mutations', 'version', 'lo',
                 'hi', 'cost', 'last_access', 'remat_count', 'users', 'inputs',
                 'cand_index', 'evicted_class', 'keepalive', 'alias_refs',
                 'born', 'recipe_nbytes', 'tensors', 'exit_versions', 'synced',
                 'carried_check', 'reaches', '__weakref__')

    def __init__(self, nbytes, device, clock):
        self.nbytes = self.recipe_nbytes = nbytes
        self.device = device
        self.cdata = self.wref = self.creator = self.keepalive = None
        self.lo = self.hi = self.evicted_class = None
        self.views = {}
        self.handles = self.out_index = self.base = self.version = 0
        self.remat_count = 0
        self.mutations = self.inputs = ()  # lists from the first entry
        self.users = self.alias_refs = self.tensors = None
        self.exit_versions = self.synced = None
        self.cost = 0.0
        self.last_access = self.born = clock
        self.carried_check = -1  # backward clock of the last carried check
        self.reaches = -1  # reach epoch when a walk found it reaches a handle
        self.cand_index = -1

    @property
    def resident(self) -> bool:
        return self.cdata is not None

    def storage(self):
        """The live storage, or ``None``."""
        return self.wref() if self.wref is not None else None

    def recomputable(self, version: int) -> bool:
        """Whether ``version`` of this storage can be rebuilt by replay."""
        return (self.lo is not None and self.lo <= version
                and (self.hi is None or version <= self.hi))

    def make_unrecomputable(self) -> None:
        """No version can be rebuilt any more: drop the recipe too, so that
        what it holds (inputs, earlier records, their recipes) can go; in a
        long scope a carried tensor would otherwise chain every iteration's
        recipes together (R7, R10)."""
        self.lo = self.hi = None
        self.creator, self.mutations, self.inputs = None, (), ()

    def add_input(self, rec) -> None:
        """Link this record to ``rec``, which its recipe reads (both ways).
        """
        if rec.users is None:
            rec.users = WeakList()
        rec.users.add(self)
        if self.inputs:
            self.inputs.append(rec)
        else:
            self.inputs = [rec]

    def live_users(self) -> list:
        """The records alive whose recipes read this one."""
        return self.users.live() if self.users is not None else []

    def has_live_users(self) -> bool:
        """Whether a record whose recipe reads this one is alive."""
        return self.users is not None and self.users.any_live()

    # DTR's evicted equivalence classes (union-find, split on rebuild) ----
    def evicted_neighbours(self):
        for rec in self.inputs:
            if rec.evicted_class is not None and not rec.resident:
                yield rec
        for rec in self.live_users():
            if rec.evicted_class is not None and not rec.resident:
                yield rec

    def evicted_neighborhood_cost(self) -> float:
        """Cost of the distinct evicted classes adjacent to this record."""
        roots = {}
        for rec in self.evicted_neighbours():
            root = rec.evicted_class.root()
            roots[id(root)] = root
        return sum(root.cost for root in roots.values())

    def join_evicted_class(self) -> None:
        """On eviction: merge with the evicted neighbours' classes."""
        if self.evicted_class is None:
            self.evicted_class = EvictedClass(self)
        for rec in list(self.evicted_neighbours()):
            a, b = self.evicted_class.root(), rec.evicted_class.root()
            if a is not b:
                a.merge(b)

    def leave_evicted_class(self) -> None:
        """On rematerialization: leave the class, splitting it exactly.

        DTR's prototype never splits (union-find cannot), so a class keeps
        the cost of members rebuilt since and e* grows stale near the memory
        floor. Here a storage with at most one evicted neighbour in its
        class (the end of a chain), or whose class more than
        :data:`SPLIT_AT_MOST` storages have joined (those rebuilt since
        count too), only takes its cost out; otherwise the class is
        re-formed from its members still evicted, in time linear in its
        size (rule R8). A class merged into another during the walk (a
        collection freed a storage whose users joined the classes, R12) is
        not split: the cost comes out of the merged class's root.
        """
        if self.evicted_class is None:
            return
        root = self.evicted_class.root()
        self.evicted_class = None
        inside = 0
        for rec in self.evicted_neighbours():
            if rec.evicted_class.root() is root:
                inside += 1
                if inside > 1:
                    break
        if root.parent is not None:
            # merged into another class during the walk: a collection freed
            # a storage whose users join the classes (fake deletion, R8;
            # the collection, R12)
            root.root().cost -= self.cost
            return
        if inside <= 1 or len(root.members) > SPLIT_AT_MOST:
            # at most one neighbour in the class: not a cut vertex, the
            # rest stays connected, only its cost goes. Rebuilding a chain
            # link by link from one end is then linear, not quadratic. A
            # larger class (counted by the storages that joined it, those
            # rebuilt since too) keeps its members connected, as DTR's
            # union-find does, with its cost exact (R8)
            root.cost -= self.cost
            return
        others = {}
        for ref in root.members:
            rec = ref()
            if rec is not None and rec.evicted_class is not None \
                    and not rec.resident and rec.evicted_class.root() is root:
                others[id(rec)] = rec
        for rec in others.values():
            rec.evicted_class = None
        for rec in others.values():
            rec.join_evicted_class()
