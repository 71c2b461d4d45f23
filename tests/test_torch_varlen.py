"""``sdpa_numba.torch.varlen_attention`` as the PyTorch operators
``torch.ops.sdpa_numba.varlen_attention_forward`` / ``varlen_attention_backward``: equality with
a per-sequence loop of the dense operator, the NumPy-level API's bits, gradcheck on ragged
batches with an empty sequence, double backward, opcheck, meta tensors, dropout seeds, and one
torch.compile(fullgraph=True) step with no graph break.

float64 throughout, to reuse the varlen kernels tests/test_varlen.py compiles (the plain recipe,
dropout); ALiBi with sinks is one more recipe (a forward and a backward)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sdpa_numba  # noqa: E402
import sdpa_numba.torch as snt  # noqa: E402
from torch_checks import Projected, assert_compiles_like_eager  # noqa: E402

ops = torch.ops.sdpa_numba

# an empty sequence, one without keys, one without queries, Lq != Lk
LQ = [3, 0, 2, 4, 0]
LK = [4, 2, 0, 5, 3]


def cu(lengths, dtype=torch.int32):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=dtype)


def packed(seed, lq=LQ, lk=LK, hq=4, h=2, e=5, ev=3, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(n), heads, d, generator=g, dtype=torch.float64)
               for n, heads, d in ((lq, hq, e), (lk, h, e), (lk, h, ev)))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)], cu(lq), cu(lk, torch.int64)


CASES = {
    "dense": dict(),
    "causal_bottom_right": dict(is_causal=True, alignment="bottom_right", scale=0.4),
    "window_softcap": dict(window=(1, 2), softcap=1.5),
}


def _dense_loop(q, k, v, cq, ck, window=None, **kw):
    """The dense operator on each sequence alone, packed back: (out, lse)."""
    left, right = window if window is not None else (None, None)
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qb, kb, vb = (x[c[b]:c[b + 1]].transpose(0, 1) for x, c in ((q, cq), (k, ck), (v, ck)))
        if kb.shape[1] == 0 or qb.shape[1] == 0:  # rows without keys: zeros and -inf
            outs.append(q.new_zeros(qb.shape[1], qb.shape[0], v.shape[-1]))
            lses.append(q.new_full((qb.shape[0], qb.shape[1]), -float("inf")))
            continue
        o, lse = ops.attention_forward(qb, kb, vb, None, 0.0, kw.get("is_causal", False),
                                       kw.get("scale"), True, None, left, right,
                                       kw.get("alignment", "top_left"), kw.get("softcap"))
        outs.append(o.transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("name", CASES)
def test_equals_a_per_sequence_loop_of_the_dense_op_and_the_numpy_api(name):
    kw = CASES[name]
    (q, k, v), cq, ck = packed(1)
    out, lse = snt.varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    assert out.shape == (sum(LQ), 4, 3) and lse.shape == (4, sum(LQ))
    assert out.dtype == lse.dtype == torch.float64 and out.is_contiguous()
    want, want_lse = _dense_loop(q, k, v, cq, ck, **kw)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    # the NumPy-level function's bits (the same kernel)
    ref, ref_lse = sdpa_numba.varlen_attention(q.numpy(), k.numpy(), v.numpy(), cq.numpy(),
                                               ck.numpy(), return_lse=True, **kw)
    np.testing.assert_array_equal(out.numpy(), ref)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)


@pytest.mark.parametrize("name", CASES)
def test_gradcheck_on_a_ragged_batch(name):
    """gradcheck of q, k, v on a batch with empty sequences (their rows and keys: zero
    gradients), GQA and Lq != Lk."""
    kw = CASES[name]
    (q, k, v), cq, ck = packed(2, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: snt.varlen_attention(q, k, v, cq, ck, **kw),
                                    (q, k, v))
    snt.varlen_attention(q, k, v, cq, ck, **kw).sum().backward()
    assert (k.grad[ck[4]:] == 0).all()  # the last sequence has no queries


def test_alibi_and_sinks_gradients():
    """Per-sequence ALiBi slopes (B, Hq) and sinks: gradcheck of q, k, v and the sinks (the
    slopes get none, as in the dense op); equal to the dense loop's gradients."""
    (q, k, v), cq, ck = packed(3, requires_grad=True)
    g = torch.Generator().manual_seed(4)
    slopes = torch.rand(len(LQ), 4, generator=g, dtype=torch.float64)
    sinks = torch.tensor([0.5, -float("inf"), -1.0, 2.0], dtype=torch.float64,
                         requires_grad=True)

    def f(q, k, v, sinks):
        return snt.varlen_attention(q, k, v, cq, ck, is_causal=True, alibi_slopes=slopes,
                                    sinks=sinks)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))
    out = f(q, k, v, sinks)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    want = []
    for b in range(len(LQ)):  # the dense op per sequence, its slopes' row
        qb, kb, vb = (x[c[b]:c[b + 1]].transpose(0, 1) for x, c in ((q, cq), (k, ck), (v, ck)))
        if qb.shape[1] and kb.shape[1]:
            want.append(snt.scaled_dot_product_attention(
                qb, kb, vb, is_causal=True, enable_gqa=True, alibi_slopes=slopes[b],
                sinks=sinks).transpose(0, 1))
        else:
            want.append(q.new_zeros(qb.shape[1], 4, 3))
    want = torch.cat(want)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v, sinks))):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_double_backward():
    """create_graph=True: the gradients are taken through torch per sequence, so they have
    second-order terms (gradgradcheck), dropout's mask included."""
    lq, lk = [2, 0, 3], [3, 2, 2]  # small: gradgradcheck differentiates numerically
    (q, k, v), cq, ck = packed(5, lq, lk, hq=2, h=1, e=3, ev=2, requires_grad=True)
    sinks = torch.tensor([0.1, -0.3], dtype=torch.float64, requires_grad=True)
    for kw in (dict(is_causal=True, softcap=2.0, sinks=sinks),
               dict(dropout_p=0.3, seed=7, window=(2, None))):
        leaves = (q, k, v, sinks) if "sinks" in kw else (q, k, v)

        def f(q, k, v, *s, kw=kw):
            return snt.varlen_attention(q, k, v, cq, ck, **dict(kw, **dict(zip(["sinks"], s))))

        assert torch.autograd.gradgradcheck(f, leaves)


def test_opcheck_and_meta():
    (q, k, v), cq, ck = packed(6, requires_grad=True)
    sinks = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    slopes = torch.full((len(LQ), 4), 0.25, dtype=torch.float64)
    seed = torch.tensor(-5, dtype=torch.int64)
    for args in [(q, k, v, cq, ck, None, None, 0.0, False, None, None),
                 (q, k, v, cq, ck, 4, 5, 0.2, True, 0.3, seed, 1, None, "bottom_right", 3.0),
                 (q, k, v, cq, ck, None, None, 0.0, True, None, None, None, None, "top_left",
                  None, slopes, sinks)]:
        torch.library.opcheck(ops.varlen_attention_forward.default, args)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = ops.varlen_attention_forward(q, k, v, cq, ck, None, None, 0.0, True, None, None)
    grad = torch.randn_like(out)
    torch.library.opcheck(ops.varlen_attention_backward.default,
                          (grad, q, k, v, out, lse, cq, ck, 0.0, True, None, None))
    meta = [t.detach().to("meta") for t in (q, k, v)]
    out, lse = snt.varlen_attention(*meta, cq.to("meta"), ck.to("meta"), return_lse=True)
    assert out.shape == (sum(LQ), 4, 3) and lse.shape == (4, sum(LQ))
    assert out.device.type == "meta" and lse.dtype == torch.float64


def test_dropout_seed_and_torch_manual_seed():
    """An explicit seed draws the NumPy-level API's mask; None draws from torch's
    generator (torch.manual_seed reproduces it)."""
    (q, k, v), cq, ck = packed(7)
    kw = dict(dropout_p=0.4, is_causal=True)
    ours = snt.varlen_attention(q, k, v, cq, ck, seed=2**63 + 5, **kw)
    theirs = sdpa_numba.varlen_attention(q.numpy(), k.numpy(), v.numpy(), cq.numpy(),
                                         ck.numpy(), seed=2**63 + 5, **kw)
    np.testing.assert_array_equal(ours.numpy(), theirs)
    torch.manual_seed(10)
    a, b = (snt.varlen_attention(q, k, v, cq, ck, **kw) for _ in range(2))
    torch.manual_seed(10)
    assert not torch.equal(a, b) and torch.equal(a, snt.varlen_attention(q, k, v, cq, ck, **kw))


def test_bad_input_is_refused_clearly():
    (q, k, v), cq, ck = packed(8)
    for kw, name in ((dict(score_mod=lambda *a: a[0]), "score_mod"),
                     (dict(mask_mod=lambda *a: True), "mask_mod"),
                     (dict(mod_args=(1,)), "mod_args")):
        with pytest.raises(NotImplementedError, match=f"{name}.*sdpa_numba.varlen_attention"):
            snt.varlen_attention(q, k, v, cq, ck, **kw)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer tensor"):
        snt.varlen_attention(q, k, v, cq.double(), ck)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor"):
        snt.varlen_attention(q, k, v, cq, ck.tolist())
    with pytest.raises(ValueError, match="cu_seqlens_q must end at"):
        snt.varlen_attention(q, k, v, cu([3, 0, 2, 3, 0]), ck)
    with pytest.raises(ValueError, match="window's left side must be >= 0"):
        snt.varlen_attention(q, k, v, cq, ck, window=(-1, 0))
    with pytest.raises(TypeError, match="q dtype torch.int64"):
        snt.varlen_attention(q.long(), k, v, cq, ck)
    with pytest.raises(RuntimeError, match="varlen_attention_backward is not differentiable"):
        out, lse = ops.varlen_attention_forward(q, k, v, cq, ck, None, None, 0.0, False, None,
                                                None)
        g = torch.ones_like(out, requires_grad=True)
        dq = ops.varlen_attention_backward(g, q, k, v, out, lse, cq, ck, 0.0, False, None,
                                           None)[0]
        dq.sum().backward()


class PackedBlock(Projected):
    """Attention over a packed ragged batch (no padding) with projections around it."""

    def forward(self, x, cq):
        n, d = x.shape
        q, k, v = (t.view(n, self.heads, d // self.heads) for t in self.qkv(x).chunk(3, -1))
        y = snt.varlen_attention(q, k, v, cq, cq, is_causal=True, window=(3, None),
                                 softcap=4.0)
        return x + self.o(y.reshape(n, d))


def test_compile_fullgraph_no_graph_break():
    """torch.compile(fullgraph=True): one graph, no break (the fake kernel's symbolic
    shapes); outputs and gradients equal eager mode's."""
    torch.manual_seed(9)
    assert_compiles_like_eager(PackedBlock(d=8), torch.randn(9, 8, dtype=torch.float64),
                               cu([4, 0, 5]))


def test_compile_dynamic_shapes_one_graph():
    """With dynamic shapes, other totals and batch sizes reuse the graph (the fake kernel's
    shapes are symbolic) and give eager mode's results."""
    torch.manual_seed(10)
    model = PackedBlock(d=8)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    with torch.no_grad():
        for i, lengths in enumerate(([4, 0, 5], [6, 7, 0], [1, 2, 3, 11])):
            x = torch.randn(sum(lengths), 8, dtype=torch.float64)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = compiled(x, cu(lengths))
            torch.testing.assert_close(got, model(x, cu(lengths)), rtol=1e-12, atol=1e-12)
