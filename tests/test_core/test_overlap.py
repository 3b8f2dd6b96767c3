"""Whether two views of a storage share an element (mmdtr/core/overlap.py)."""
import random

import torch

from mmdtr.core.overlap import views_overlap
from mmdtr.core.records import view_meta


def _elements(t):
    n = t.untyped_storage().nbytes() // t.element_size()
    index = torch.as_strided(
        torch.arange(n), t.shape, t.stride(), t.storage_offset())
    return set(index.flatten().tolist())


def test_never_misses_an_overlap_and_is_exact_for_chunks():
    rng = random.Random(0)
    exact = 0
    for _ in range(2000):
        x = torch.zeros([rng.randint(1, 5) for _ in range(rng.randint(1, 3))])
        if x.dim() > 1 and rng.random() < 0.5:
            x = x.transpose(0, -1)
        dim = rng.randrange(x.dim())
        chunks = x.unsafe_chunk(rng.randint(1, 3), dim)
        views = [*chunks, x, x.narrow(dim, 0, max(1, x.shape[dim] // 2))]
        a, b = rng.choice(views), rng.choice(views)
        truth = bool(_elements(a) & _elements(b))
        answer = views_overlap(view_meta(a), view_meta(b))
        assert answer or not truth, (a.shape, a.stride(), b.stride())
        if a.shape == b.shape and a.stride() == b.stride():
            assert answer == truth
        exact += answer == truth
    assert exact > 1900


def test_interleaved_chunks_and_empty_views():
    gates = torch.zeros(4, 6)
    a, b = gates.unsafe_chunk(2, 1)  # interleaved: rows share no element
    assert not views_overlap(view_meta(a), view_meta(b))
    assert views_overlap(view_meta(a), view_meta(gates))
    assert not views_overlap(view_meta(gates[:0]), view_meta(gates))
    # another dtype over the same bytes: compared by byte spans
    assert views_overlap(view_meta(gates.view(torch.int32)), view_meta(a))
