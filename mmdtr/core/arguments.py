"""The tensors among an op call's arguments, and the storages behind them.

Strided tensors have one storage each, which the engine records, versions
and evicts; sparse ones are made of strided parts (indices, values), which
may be a recorded tensor's storage (``sparse_coo_tensor(i, h)`` shares
``h``'s) and are written when the sparse tensor is (R5, R7, R11). Nested
and quantized tensors are held, never recorded, but their storages are
metered (:func:`held_parts`, R11). Opaque layouts (mkldnn) have no storage
to track (R4).
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
_PER_CHANNEL = (torch.per_channel_affine, torch.per_channel_symmetric,
                torch.per_channel_affine_float_qparams)


def sparse_parts(t: Tensor) -> tuple:
    """The strided tensors a sparse tensor is made of.

    Args:
        t (Tensor): A tensor of a layout in :data:`SPARSE_LAYOUTS`.
    """
    if t.layout is torch.sparse_coo:
        return t._indices(), t._values()
    return tuple(getattr(t, name)()
                 for name in _COMPRESSED_PARTS[t.layout]) + (t.values(), )


#: the tensors a nested tensor (strided layout) keeps its components'
#: sizes, strides and offsets in, beside its buffer
_NESTED_METADATA = ('_nested_tensor_size', '_nested_tensor_strides',
                    '_nested_tensor_storage_offsets')


def held_parts(t: Tensor) -> tuple:
    """The tensors whose storages hold a tensor the engine holds and never
    records (R4), for the meter (R11): a sparse tensor's parts, a nested
    tensor with its metadata, a quantized tensor with its per-channel
    scales and zero points, ``t`` itself for other strided tensors, none
    for a zero tensor or an opaque layout (mkldnn: no storage, not
    metered). The nested and quantized cases were found by an adversarial
    search.

    Args:
        t (Tensor): A tensor that is not ``managed``.
    """
    if t.layout in SPARSE_LAYOUTS:
        return sparse_parts(t)
    if t.layout is not _STRIDED or t.is_meta or t._is_zerotensor():
        return ()  # a zero tensor's storage has a size but no memory
    if t.is_nested:
        return (t, ) + tuple(getattr(t, name)() for name in _NESTED_METADATA)
    if t.is_quantized and t.qscheme() in _PER_CHANNEL:
        return t, t.q_per_channel_scales(), t.q_per_channel_zero_points()
    return (t, )


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


def argument_storages(args, kwargs, held: bool = False) -> set:
    """Addresses of the storages of a call's tensor arguments, sparse ones'
    parts included.

    Args:
        args (Sequence): Positional arguments.
        kwargs (dict): Keyword arguments.
        held (bool): Include the metadata of nested and quantized ones
            (:func:`held_parts`). Defaults to False.
    """
    parts = []
    strided = tensors_in((*args, *kwargs.values()), parts)
    if held:
        parts += [
            p for t in strided if t.is_nested or t.is_quantized
            for p in held_parts(t)
        ]
    return {t.untyped_storage()._cdata for t in strided + parts}
