"""Whether two views of one storage share an element (rule R10).

Autograd checks a saved tensor's version counter, which views share but
``unsafe_chunk``/``unsafe_split`` outputs do not: the gates of PyTorch's
GRU and LSTM cells are such chunks, written in place next to a saved
sibling. The engine versions whole storages, so before it calls a write
after a save a conflict it asks whether the write touched the saved view's
elements at all.
"""
#: candidate digits tried before :func:`views_overlap` gives up (and says
#: "overlap", the safe answer)
_MAX_STEPS = 10000


def _span(meta):
    """First and one-past-last byte a view addresses, or ``None`` if empty.
    """
    dtype, shape, stride, offset = meta
    if any(size == 0 for size in shape):
        return None
    lo = hi = offset
    for size, step in zip(shape, stride):
        lo += min(0, (size - 1) * step)
        hi += max(0, (size - 1) * step)
    return lo * dtype.itemsize, (hi + 1) * dtype.itemsize


def views_overlap(a, b) -> bool:
    """Whether views ``a`` and ``b`` (``view_meta`` tuples) of one storage
    address a common element.

    Exact for views of the same dtype, shape and strides (chunks and splits
    along a dimension, narrowing); other pairs are compared by their byte
    spans, which may answer "overlap" for interleaved views that do not
    share an element (the engine then errs on the safe side).
    """
    span_a, span_b = _span(a), _span(b)
    if span_a is None or span_b is None or span_a[1] <= span_b[0] \
            or span_b[1] <= span_a[0]:
        return False
    if a[:3] != b[:3]:
        return True
    dims = sorted(
        ((step, size)
         for size, step in zip(a[1], a[2]) if size > 1 and step != 0),
        reverse=True)
    budget = [_MAX_STEPS]
    return _representable(b[3] - a[3], dims, budget)


def _representable(d, dims, budget) -> bool:
    """Whether ``d == sum(c_k * step_k)`` with ``|c_k| < size_k``."""
    if not dims:
        return d == 0
    (step, size), rest = dims[0], dims[1:]
    reach = sum((n - 1) * s for s, n in rest)
    first = max(-(size - 1), -((reach - d) // step))  # ceil, in integers
    last = min(size - 1, (d + reach) // step)
    for c in range(first, last + 1):
        budget[0] -= 1
        if budget[0] < 0 or _representable(d - c * step, rest, budget):
            return True
    return False
