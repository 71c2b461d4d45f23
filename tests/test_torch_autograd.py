"""sdpa_numba.torch: the operator's values and gradients against torch, in float64.

(float32 and float16 go through the same code, on kernels tested at the NumPy level in
test_backward.py; not repeated here, to save compiling their forwards.)"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sdpa_numba.torch as snt  # noqa: E402

F = torch.nn.functional


def randn(*shape, dtype=torch.float64, requires_grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


def test_imports_real_torch():
    assert snt.torch is torch


def test_gradcheck_plain_and_float_mask():
    torch.manual_seed(0)
    q, k, v = randn(2, 2, 7, 4), randn(2, 2, 9, 4), randn(2, 2, 9, 3)
    assert torch.autograd.gradcheck(snt.scaled_dot_product_attention, (q, k, v))
    mask = randn(2, 7, 9)  # broadcast over batch: its gradient is summed over it
    assert torch.autograd.gradcheck(
        lambda q, k, v, m: snt.scaled_dot_product_attention(q, k, v, m, is_causal=True),
        (q, k, v, mask))


def test_gradcheck_gqa_causal_dropout():
    torch.manual_seed(1)
    q, k, v = randn(1, 4, 6, 4), randn(1, 2, 8, 4), randn(1, 2, 8, 5)
    assert torch.autograd.gradcheck(
        lambda q, k, v: snt.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, dropout_p=0.3, seed=17),
        (q, k, v))


def test_matches_torch_values_and_grads():
    torch.manual_seed(2)
    q, k, v = randn(2, 4, 33, 16), randn(2, 2, 70, 16), randn(2, 2, 70, 8)
    mask = randn(4, 33, 70)
    mask.data[:, 3] = -float("inf")  # fully masked row: torch gives NaN there, skip it
    g = torch.randn(2, 4, 33, 8, dtype=torch.float64)
    kw = dict(enable_gqa=True, scale=0.2)
    ours = snt.scaled_dot_product_attention(q, k, v, mask, **kw)
    ours.backward(g)
    mine = [t.grad.clone() for t in (q, k, v, mask)]
    for t in (q, k, v, mask):
        t.grad = None
    rows = [i for i in range(33) if i != 3]
    theirs = F.scaled_dot_product_attention(q, k, v, mask, **kw)
    (theirs[:, :, rows] * g[:, :, rows]).sum().backward()
    torch.testing.assert_close(ours[:, :, rows], theirs[:, :, rows], rtol=1e-12, atol=1e-12)
    assert (ours[:, :, 3] == 0).all() and (mine[0][:, :, 3] == 0).all()
    # our row 3 is 0 with zero gradients; torch's is NaN, so compare without it
    mine[0][:, :, 3] = 0
    q.grad[:, :, 3] = 0
    for a, b in zip(mine, (q.grad, k.grad, v.grad, mask.grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_dropout_without_seed_replays_its_mask():
    """seed=None: the forward draws a seed and the backward reuses it (V = I shows Z)."""
    torch.manual_seed(4)
    S = 40
    q, k = randn(1, 2, 30, 8), randn(1, 2, S, 8)
    v = torch.eye(S, dtype=torch.float64).expand(1, 2, S, S).clone().requires_grad_()
    out = snt.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    g = torch.randn_like(out)
    out.backward(g)
    # out = P Z, so dV = (P Z)ᵀ dO = outᵀ g exactly when the same mask is used
    torch.testing.assert_close(v.grad, out.detach().transpose(-1, -2) @ g, rtol=1e-12,
                               atol=1e-12)


def test_meta_tensors_get_shapes():
    """Meta tensors go through the operator's fake kernel: shapes only, no kernel runs.
    (CUDA tensors run on the CUDA kernels: tested on a GPU in tests/cuda.)"""
    q = torch.empty(3, 2, 5, 4, device="meta")
    k, v = torch.empty(2, 7, 4, device="meta"), torch.empty(2, 7, 6, device="meta")
    out = snt.scaled_dot_product_attention(q, k, v)
    assert out.device.type == "meta" and out.shape == (3, 2, 5, 6)


def test_unsupported_dtype_is_a_type_error():
    q = torch.zeros(1, 2, 3, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="int32"):
        snt.scaled_dot_product_attention(q, q, q)


class ToyAttention(torch.nn.Module):
    def __init__(self, d, heads, attention):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d, dtype=torch.float64)
        self.proj = torch.nn.Linear(d, d, dtype=torch.float64)
        self.attention = attention

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


def test_training_matches_torch_sdpa():
    """A few SGD steps on a toy attention layer: same losses as with torch's own SDPA."""
    torch.manual_seed(5)
    x = torch.randn(3, 21, 16, dtype=torch.float64)
    target = torch.randn(3, 21, 16, dtype=torch.float64)
    ours = ToyAttention(16, 4, snt.scaled_dot_product_attention)
    theirs = ToyAttention(16, 4, F.scaled_dot_product_attention)
    theirs.load_state_dict(ours.state_dict())
    losses = []
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        run = []
        for _ in range(6):
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    np.testing.assert_allclose(losses[0], losses[1], rtol=0, atol=1e-9)
    assert losses[0][-1] < losses[0][0]
