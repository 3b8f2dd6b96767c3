"""Views the engine cannot rebuild (a conjugate or negative bit) over a
storage it records (R4, R5, R7).

Such a view is held, never rebuilt; an op that reads or writes one through
a recorded storage gets no recipe, so its outputs are kept and a write
through it caps the storage's recomputable versions. Each case runs a step
without DTR and under the smallest threshold and compares every returned
tensor bit for bit (the ``same_under_dtr`` fixture). Found by an adversarial
search; the two writes failed before the fix.
"""
import pytest
import torch


@pytest.mark.parametrize('bit', ['conj', 'neg'])
def test_views_with_a_conjugate_or_negative_bit_are_held(bit, same_under_dtr):
    x = torch.randn(8, 8, dtype=torch.cfloat)
    w = torch.randn(8, 8, dtype=torch.cfloat, requires_grad=True)

    def step():
        w.grad = None
        h = (x @ w).add(1)
        if bit == 'conj':
            y = (h.conj() @ h).exp().abs()  # mm saves the conj view
        else:
            n = h.conj().imag  # a negative-bit view
            y = (n * n.exp()).sin()
        del h
        loss = y.sum()
        loss.backward()
        return [loss, w.grad]

    same_under_dtr(step)


def _complex_leaves():
    x = torch.randn(64, dtype=torch.cfloat, requires_grad=True)
    w = torch.randn(64, dtype=torch.cfloat, requires_grad=True)
    return x, w


@pytest.mark.parametrize('bit', ['conj', 'neg'])
def test_read_through_a_view_then_a_write_to_its_base(bit, same_under_dtr):
    # the read of y through its conj (or negative) view was recorded
    # without y's version: after y.mul_(3) a rebuild read the new values
    def step():
        x, w = _complex_leaves()
        y = x * 2
        view = y.conj() if bit == 'conj' else y.conj().imag
        p = (view + 1) * w  # mul saves view + 1, rebuilt from the view
        y.mul_(3)  # nothing saved y or its view: eager allows it
        del view
        torch.ones(1 << 21).exp()  # above the peak: p's input goes
        loss = p.real.sum() + (y * w).real.sum()
        loss.backward()
        return [loss, w.grad, x.grad]

    same_under_dtr(step)


def test_write_through_a_conjugate_view(same_under_dtr):
    # the write's recipe held the live storage where it should have
    # written the one being rebuilt: the rebuilt version missed the write
    # and the live y got it a second time
    def step():
        x, w = _complex_leaves()
        y = x * 2
        y.conj().mul_(2)  # conj fallback: clone, mul_, copy_ into the view
        p = (y + 1) * w  # reads y after that write; mul saves y + 1
        y.mul_(3)
        torch.ones(1 << 21).exp()  # above the peak: p's input goes
        loss = p.real.sum() + (y * w).real.sum()
        loss.backward()
        return [loss, w.grad, x.grad, y.detach()]

    same_under_dtr(step)
