"""``matmul_lifting_subnormals``: the plain product's bits where its sums stay normal, the exact
product rounded once where a row of ``a`` is subnormal throughout, and the plain path where lifting
could overflow.  ``lifting_subnormal_grads``: autograd's gradient bit for bit, computed by a chain that
never sees the subnormals, scaled back on this path's share only."""

from __future__ import annotations

import numpy as np
import torch

from caffe_compat.losses.pairwise import lifting_subnormal_grads, matmul_lifting_subnormals

TINY = float(np.finfo(np.float32).tiny)   # 2^-126, the smallest normal float32


def _mixed(seed: int, rows: int = 64, inner: int = 64, cols: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` whose entries are a mix of normal values and subnormals down to 2^-149, ``b`` normal."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, inner, generator=gen)
    tiny = torch.rand(rows, inner, generator=gen) < 0.3
    a = torch.where(tiny, a * 2.0 ** -130, a)              # subnormal: |a| < 2^-126
    assert bool(((a.abs() < TINY) & (a != 0)).any())
    return a, torch.randn(inner, cols, generator=gen)


def test_equals_the_plain_product_bitwise_when_the_sums_stay_normal():
    for seed in range(5):
        a, b = _mixed(seed)
        assert torch.equal(matmul_lifting_subnormals(a, b), a @ b)


def test_a_subnormal_row_gives_the_exact_product_rounded_once():
    a, b = _mixed(0)
    a[3] = torch.randn(a.shape[1], generator=torch.Generator().manual_seed(9)) * 2.0 ** -140
    ours = matmul_lifting_subnormals(a, b)
    exact = a.double() @ b.double()                        # the float32 inputs, multiplied exactly enough
    # the lifted sums are normal: K float32 roundings of at most eps/2 relative to Σ|a||b|, then one
    # rounding into the subnormal range (half of 2^-149)
    bound = a.shape[1] * 2.0 ** -24 * (a.double().abs() @ b.double().abs()) + 2.0 ** -150
    assert bool(((ours.double() - exact).abs() <= bound).all())
    assert bool(ours[3].ne(0).any())                       # nothing flushed to zero


def test_scaling_that_could_overflow_takes_the_plain_product():
    a, b = _mixed(1)
    a[0, 0] = 3e30                                         # max|a|·2^24·K·max|b| is past FLT_MAX
    assert torch.equal(matmul_lifting_subnormals(a, b), a @ b)
    a[0, 0] = float("nan")
    assert torch.equal(matmul_lifting_subnormals(a, b).isnan(), (a @ b).isnan())


def test_other_dtypes_and_normal_inputs_are_the_plain_product():
    a, b = _mixed(2)
    assert torch.equal(matmul_lifting_subnormals(a.double(), b.double()), a.double() @ b.double())
    normal = torch.randn(8, 5)
    assert torch.equal(matmul_lifting_subnormals(normal, b[:5]), normal @ b[:5])


class _Seen:
    """``fn`` for lifting_subnormal_grads: ``rows @ w`` (a GEMM in the chain), recording the gradient the
    chain receives."""

    def __init__(self, w: torch.Tensor):
        self.w, self.grads = w, []

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        out = rows @ self.w
        out.register_hook(self.grads.append)
        return out


def _grad_of(x: torch.Tensor, fn, g: torch.Tensor, lifted: bool) -> torch.Tensor:
    leaf = x.clone().requires_grad_()
    out = lifting_subnormal_grads(fn, leaf) if lifted else fn(leaf)
    out.backward(g)
    return leaf.grad


def test_the_chain_sees_the_lifted_gradient_and_the_input_gets_autograds_bits():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 24, generator=gen), torch.randn(24, 32, generator=gen)
    g, _ = _mixed(3, rows=16, inner=32)                       # an upstream gradient with subnormals
    seen = _Seen(w)
    ours = _grad_of(x, seen, g, lifted=True)
    assert torch.equal(seen.grads[0], g * 2.0 ** 24)         # exact: a power of two
    assert not bool(((seen.grads[0].abs() < TINY) & (seen.grads[0] != 0)).any())
    assert torch.equal(ours, _grad_of(x, lambda r: r @ w, g, lifted=False))  # the sums stay normal


def test_only_this_paths_share_of_the_gradient_is_scaled_back():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(16, 24, generator=gen), torch.randn(24, 32, generator=gen)
    g, _ = _mixed(4, rows=16, inner=32)
    for lifted in (True, False):
        leaf = x.clone().requires_grad_()
        out = lifting_subnormal_grads(lambda r: r @ w, leaf) if lifted else leaf @ w
        ((out * g).sum() + (leaf * 3.0).sum()).backward()     # x also feeds another term
        if lifted:
            ours = leaf.grad
        else:
            assert torch.equal(ours, leaf.grad)


def test_no_lift_without_subnormals_or_when_it_could_overflow():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 24, generator=gen), torch.randn(24, 32, generator=gen)
    normal = torch.randn(16, 32, generator=gen)
    big, _ = _mixed(6, rows=16, inner=32)
    big[0, 0] = 2.0 ** 25                                     # past the 2^24 bound
    for g in (normal, big):
        seen = _Seen(w)
        _grad_of(x, seen, g, lifted=True)
        assert torch.equal(seen.grads[0], g)


def test_off_the_cpu_and_without_autograd_fn_runs_alone():
    """GPUs take subnormals at full speed: off the CPU (here the meta device) no node is added, as without a
    gradient to compute."""
    for x in (torch.ones(4, 4, device="meta", requires_grad=True), torch.ones(4, 4)):
        y = lifting_subnormal_grads(lambda r: r * 2.0, x)
        assert y.grad_fn is None or type(y.grad_fn).__name__ == "MulBackward0"
    y = lifting_subnormal_grads(lambda r: r * 2.0, torch.ones(4, 4, requires_grad=True))
    assert type(y.grad_fn).__name__ == "_LiftOutputGradBackward"
