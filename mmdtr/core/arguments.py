"""The tensors among an op call's arguments, and the storages behind them.

Strided tensors have one storage each, which the engine records, versions
and evicts; sparse ones are made of strided parts (indices, values), which
may be a recorded tensor's storage (``sparse_coo_tensor(i, h)`` shares
``h``'s) and are written when the sparse tensor is (R5, R7, R11). Other
layouts have no storage to track (R4).
"""
import torch

Tensor = torch.Tensor
_STRIDED = torch.strided
_COMPRESSED_PARTS = {
    torch.sparse_csr: ('crow_indices', 'col_indices'),
    torch.sparse_bsr: ('crow_indices', 'col_indices'),
    torch.sparse_csc: ('ccol_indices', 'row_indices'),
    torch.sparse_bsc: ('ccol_indices', 'row_indices'),
}
SPARSE_LAYOUTS = frozenset(_COMPRESSED_PARTS) | {torch.sparse_coo}


def sparse_parts(t: Tensor) -> tuple:
    """The strided tensors a sparse tensor is made of.

    Args:
        t (Tensor): A tensor of a layout in :data:`SPARSE_LAYOUTS`.
    """
    if t.layout is torch.sparse_coo:
        return t._indices(), t._values()
    return tuple(getattr(t, name)()
                 for name in _COMPRESSED_PARTS[t.layout]) + (t.values(), )


def tensors_in(values, sparse_parts_to=None) -> list:
    """The strided tensors among ``values``, and in their lists (one level).

    Args:
        values (Iterable): A call's arguments.
        sparse_parts_to (list, optional): If given, the parts of the sparse
            tensors among them are appended to it.
    """
    tensors = []
    for a in values:
        if isinstance(a, Tensor):
            tensors.append(a)
        elif isinstance(a, (list, tuple)):
            tensors += [b for b in a if isinstance(b, Tensor)]
    strided = [t for t in tensors if t.layout is _STRIDED]
    if sparse_parts_to is not None and len(strided) < len(tensors):
        sparse_parts_to += [
            p for t in tensors if t.layout in SPARSE_LAYOUTS
            for p in sparse_parts(t)
        ]
    return strided


def argument_storages(args, kwargs) -> set:
    """Addresses of the storages of a call's tensor arguments, sparse ones'
    parts included.

    Args:
        args (Sequence): Positional arguments.
        kwargs (dict): Keyword arguments.
    """
    parts = []
    strided = tensors_in((*args, *kwargs.values()), parts)
    return {t.untyped_storage()._cdata for t in strided + parts}
