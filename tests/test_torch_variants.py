"""The variants through the PyTorch operator (sdpa_numba.torch): window, alignment, soft cap,
ALiBi and sinks against the float64 reference (outputs and gradients, the sinks' included),
opcheck, double backward, vmap, torch.compile(fullgraph=True), and the variants the schema
cannot carry refused clearly.

float64 throughout, to reuse the kernels other tests compile (windows, alignment and the soft
cap share the plain recipe's specialization; ALiBi and sinks are one more each)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sdpa_numba import reference  # noqa: E402
import sdpa_numba.torch as snt  # noqa: E402
from torch_checks import Projected, assert_compiles_like_eager  # noqa: E402

ops = torch.ops.sdpa_numba


def randn(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)


def _np(t):
    return None if t is None else t.detach().numpy()


CASES = [  # (window, alignment, is_causal, softcap, alibi, sinks)
    ((3, 1), "top_left", False, None, False, False),
    ((4, None), "bottom_right", True, None, False, False),
    ((None, 2), "bottom_right", False, 1.5, False, False),
    (None, "top_left", True, 0.8, False, False),
    ((5, 0), "bottom_right", False, None, True, False),
    (None, "top_left", False, 2.0, True, True),
    ((2, 3), "bottom_right", True, None, False, True),
]


@pytest.mark.parametrize("window,alignment,causal,softcap,alibi,sinks", CASES)
@pytest.mark.parametrize("L,S", [(6, 9), (9, 5)])
def test_forward_and_gradients_match_the_reference(L, S, window, alignment, causal, softcap,
                                                   alibi, sinks):
    """GQA with a batch dim, odd sizes, L < S and L > S (bottom-right: rows with no key);
    every gradient (the sinks' too) against reference.attention_backward."""
    torch.manual_seed(L * 10 + S)
    q = randn(2, 4, L, 5, requires_grad=True)
    k, v = randn(2, 2, S, 5, requires_grad=True), randn(2, 2, S, 3, requires_grad=True)
    slopes = torch.rand(2, 4, dtype=torch.float64) if alibi else None  # per batch entry
    sink = randn(4, requires_grad=True) if sinks else None
    kw = dict(window=window, alignment=alignment, softcap=softcap)
    out = snt.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, **kw,
                                           alibi_slopes=slopes, sinks=sink)
    want, _ = reference.attention(_np(q), _np(k), _np(v), is_causal=causal, enable_gqa=True,
                                  **kw, alibi_slopes=_np(slopes), sinks=_np(sink))
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    go = torch.randn_like(out)
    leaves = [q, k, v] + ([sink] if sinks else [])
    grads = torch.autograd.grad(out, leaves, go)
    ref = reference.attention_backward(_np(go), _np(q), _np(k), _np(v), is_causal=causal,
                                       enable_gqa=True, **kw, alibi_slopes=_np(slopes),
                                       sinks=_np(sink))
    wants = list(ref[:3]) + ([ref[4]] if sinks else [])
    for g, w in zip(grads, wants):
        assert g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-10, atol=1e-11)


def test_opcheck_with_variants():
    """Schema, fake kernels against the real ones, autograd registration, with every variant
    argument given (and the backward's d sinks output)."""
    torch.manual_seed(1)
    q, k, v = randn(2, 2, 5, 4, requires_grad=True), randn(2, 7, 4), randn(2, 7, 3)
    slopes, sink = torch.rand(2, dtype=torch.float64), randn(2, requires_grad=True)
    args = (q, k, v, None, 0.0, True, None, False, None, 3, None, "bottom_right", 2.0, slopes,
            sink)
    torch.library.opcheck(ops.attention_forward.default, args)
    out, lse = ops.attention_forward(*args)
    grad = torch.randn_like(out)
    torch.library.opcheck(ops.attention_backward.default,
                          (grad, q.detach(), k, v, out.detach(), lse, None, 0.0, True, None,
                           False, None, False, 3, None, "bottom_right", 2.0, slopes,
                           sink.detach()))


def test_sixteen_bit_sinks_and_slopes_are_read_in_float32():
    """gpt-oss keeps its sinks in bfloat16: the gradient comes back in the sinks' dtype."""
    torch.manual_seed(2)
    q = torch.randn(2, 5, 4, dtype=torch.float16)
    sink = torch.randn(2, dtype=torch.bfloat16, requires_grad=True)
    slopes = torch.rand(2, dtype=torch.float16)
    out = snt.scaled_dot_product_attention(q, q, q, sinks=sink, alibi_slopes=slopes)
    want, _ = reference.attention(q.float().numpy(), q.float().numpy(), q.float().numpy(),
                                  sinks=sink.detach().float().numpy(),
                                  alibi_slopes=slopes.float().numpy())
    np.testing.assert_allclose(out.float().detach().numpy(), want, rtol=2e-3, atol=2e-3)
    (g,) = torch.autograd.grad(out.float().sum(), sink)
    assert g.dtype == torch.bfloat16 and g.shape == (2,)


def _penalized(f, *leaves):
    """Gradients of a loss with a gradient penalty: needs the double backward."""
    out = f(*leaves)
    grads = torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
    loss = out.sum() + sum(g.square().sum() for g in grads)
    return torch.autograd.grad(loss, leaves)


def test_double_backward_with_variants():
    """create_graph=True with window, alignment, soft cap, ALiBi and sinks: the torch-side
    first-order gradients equal the kernels', and gradgradcheck's finite differences agree."""
    torch.manual_seed(3)
    q, k, v = (randn(1, 2, 4, 3, requires_grad=True), randn(1, 2, 6, 3, requires_grad=True),
               randn(1, 2, 6, 3, requires_grad=True))
    sink = randn(2, requires_grad=True)
    slopes = torch.rand(2, dtype=torch.float64)

    def f(q, k, v, sink):
        return snt.scaled_dot_product_attention(q, k, v, is_causal=True, window=(2, None),
                                                alignment="bottom_right", softcap=1.3,
                                                alibi_slopes=slopes, sinks=sink)

    leaves = (q, k, v, sink)
    first = torch.autograd.grad(f(*leaves).square().sum(), leaves)  # the kernels
    graph = torch.autograd.grad(f(*leaves).square().sum(), leaves, create_graph=True)
    for a, b in zip(graph, first):  # the dense torch formula
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert all(torch.isfinite(g).all() for g in _penalized(f, *leaves))
    assert torch.autograd.gradgradcheck(f, leaves)


def test_vmap_batched_alibi_and_sinks():
    """Batched slopes fold into the batch dims; sinks (batched or not) run one call per
    index. Both equal a Python loop, gradients (the sinks' per index) included."""
    torch.manual_seed(4)
    q, k, v = randn(3, 2, 5, 4), randn(2, 7, 4), randn(3, 2, 7, 3)
    slopes = torch.rand(3, 2, dtype=torch.float64)
    f = lambda q, v, s: snt.scaled_dot_product_attention(  # noqa: E731
        q, k, v, alibi_slopes=s, window=(3, 1), softcap=2.0)
    batched = torch.vmap(f)(q, v, slopes)
    loop = torch.stack([f(q[i], v[i], slopes[i]) for i in range(3)])
    torch.testing.assert_close(batched, loop, rtol=0, atol=0)

    sinks = randn(3, 2)
    g = lambda q, s: snt.scaled_dot_product_attention(q, k, k, sinks=s)  # noqa: E731
    torch.testing.assert_close(torch.vmap(g)(q, sinks),
                               torch.stack([g(q[i], sinks[i]) for i in range(3)]),
                               rtol=0, atol=0)
    shared = randn(2)
    out, lse = torch.vmap(lambda q: ops.attention_forward(
        q, k, k, None, 0.0, False, None, False, None, None, None, "top_left", None, None,
        shared))(q)
    go = torch.randn_like(out)
    ds = torch.vmap(lambda go, q, o, lse: ops.attention_backward(
        go, q, k, k, o, lse, None, 0.0, False, None, False, None, False, None, None,
        "top_left", None, None, shared)[4])(go, q, out, lse)
    for i in range(3):  # per-index gradients of the shared sinks, not their sum
        one = ops.attention_backward(go[i], q[i], k, k, out[i], lse[i], None, 0.0, False,
                                     None, False, None, False, None, None, "top_left", None,
                                     None, shared)[4]
        torch.testing.assert_close(ds[i], one, rtol=0, atol=0)


def test_what_cannot_cross_the_schema_is_refused_clearly():
    q = randn(1, 2, 3, 4)
    for kw, name in ((dict(score_mod=lambda *a: a[0]), "score_mod"),
                     (dict(mask_mod=lambda *a: True), "mask_mod"),
                     (dict(block_mask=object()), "block_mask"),
                     (dict(mod_args=(1,)), "mod_args")):
        with pytest.raises(NotImplementedError,
                           match=f"{name}.*sdpa_numba.scaled_dot_product_attention"):
            snt.scaled_dot_product_attention(q, q, q, **kw)
    with pytest.raises(ValueError, match="window's left side must be >= 0"):
        snt.scaled_dot_product_attention(q, q, q, window=(-1, 0))
    with pytest.raises(TypeError, match="window must be None or a pair"):
        snt.scaled_dot_product_attention(q, q, q, window=3)
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        snt.scaled_dot_product_attention(q, q, q, sinks=np.zeros(2))
    with pytest.raises(ValueError, match="softcap"):
        snt.scaled_dot_product_attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="alignment"):
        snt.scaled_dot_product_attention(q, q, q, alignment="middle")


class Block(Projected):
    """Attention with a soft cap and a sliding window (Gemma-2 style) and an MLP."""

    def __init__(self, d=16, heads=2):
        super().__init__(d, heads)
        kw = dict(dtype=torch.float64)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d, **kw), torch.nn.GELU(),
                                       torch.nn.Linear(2 * d, d, **kw))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = snt.scaled_dot_product_attention(q, k, v, is_causal=True, window=(3, 0),
                                             softcap=5.0, alignment="bottom_right")
        x = x + self.o(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(x)


def test_compile_fullgraph_with_softcap_and_window():
    """torch.compile(fullgraph=True): one graph, no break; outputs and gradients equal eager
    mode's."""
    torch.manual_seed(5)
    assert_compiles_like_eager(Block(), randn(2, 7, 16))
