"""sdpa_numba.torch as a PyTorch operator: opcheck, torch.compile with no graph break, double
backward, vmap, dropout replay, dtypes.

float64 throughout (and one float16 case), to reuse the kernels other tests compile."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sdpa_numba  # noqa: E402
import sdpa_numba.torch as snt  # noqa: E402

ops = torch.ops.sdpa_numba
F = torch.nn.functional


def randn(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)


# ---------------------------------------------------------------- the operators themselves


def test_opcheck_forward():
    """Schema, autograd registration, fake kernel against the real one, AOT dispatch."""
    torch.manual_seed(0)
    q, k, v = (randn(2, 2, 5, 4, requires_grad=True), randn(2, 7, 4, requires_grad=True),
               randn(2, 7, 3, requires_grad=True))
    mask = randn(5, 7, requires_grad=True)
    samples = [
        (q, k, v, None, 0.0, False, None, False, None),
        (q, k, v, mask, 0.0, True, 0.3, False, None),  # float mask with a gradient
        (q, randn(1, 7, 4), randn(1, 7, 3), mask.detach() > 0, 0.2, False, None, True,
         torch.tensor(-5, dtype=torch.int64)),  # bool mask, GQA, dropout with a seed
    ]
    for args in samples:
        torch.library.opcheck(ops.attention_forward.default, args)


def test_opcheck_backward():
    torch.manual_seed(1)
    q, k, v, mask = randn(2, 2, 5, 4), randn(2, 7, 4), randn(2, 7, 3), randn(5, 7)
    out, lse = ops.attention_forward(q, k, v, mask, 0.0, True, None, False, None)
    grad = torch.randn_like(out)
    for mask_grad in (True, False):
        torch.library.opcheck(ops.attention_backward.default,
                              (grad, q, k, v, out, lse, mask, 0.0, True, None, False, None,
                               mask_grad))


def test_float16_fake_matches_real():
    """float16: out in float16, lse in float32 (the compute dtype), in both kernels."""
    q = torch.randn(1, 2, 5, 4, dtype=torch.float16)
    torch.library.opcheck(ops.attention_forward.default,
                          (q, q, q, None, 0.0, False, None, False, None),
                          test_utils=("test_schema", "test_faketensor"))
    out, lse = ops.attention_forward(q, q, q, None, 0.0, False, None, False, None)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32


def test_unsupported_dtype_is_a_type_error_naming_the_dtype():
    b = torch.zeros(1, 2, 3, 4, dtype=torch.complex64)
    f = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="query dtype torch.complex64"):
        snt.scaled_dot_product_attention(b, b, b)
    with pytest.raises(TypeError, match="attn_mask dtype torch.complex64"):
        snt.scaled_dot_product_attention(f, f, f, torch.zeros(3, 3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="query dtype torch.complex64"):
        ops.attention_forward(b, b, b, None, 0.0, False, None, False, None)
    with pytest.raises(TypeError, match="key dtype torch.int64"):
        snt.scaled_dot_product_attention(f, f.long(), f)


def _mixed_device_calls():
    """Every operator called with CPU and meta tensors mixed: (what, call, the argument on
    meta). Without the check the Meta dispatch key won and the fake kernel returned a CPU
    tensor of uninitialized memory."""
    q, k, v = randn(1, 2, 5, 4), randn(1, 2, 7, 4), randn(1, 2, 7, 3)
    out, lse = randn(1, 2, 5, 3), randn(1, 2, 5)
    meta = torch.empty(1, 2, 7, 4, device="meta")
    kc, vc = randn(2, 9, 2, 4), randn(2, 9, 2, 3)
    qd, lens = randn(2, 1, 2, 4), torch.tensor([3, 4])
    qv, kv, vv = randn(6, 2, 4), randn(9, 2, 4), randn(9, 2, 3)
    cu_q, cu_k = torch.tensor([0, 2, 6]), torch.tensor([0, 4, 9])
    return [
        ("attention_forward", lambda: ops.attention_forward(
            q, meta, meta.new_empty(1, 2, 7, 3), None, 0.0, False, None, False, None), "key"),
        ("attention_forward", lambda: ops.attention_forward(
            q, k, v, torch.empty(5, 7, device="meta"), 0.0, False, None, False, None),
         "attn_mask"),
        ("attention_backward", lambda: ops.attention_backward(
            out.to("meta"), q, k, v, out, lse, None, 0.0, False, None, False, None, False),
         "grad_out"),
        ("attention_forward", lambda: snt.scaled_dot_product_attention(
            q.to("meta"), k, v), "query"),
        ("attention_with_kvcache", lambda: snt.attention_with_kvcache(
            qd, kc.to("meta"), vc.to("meta"), lens), "k_cache"),
        ("attention_with_kvcache", lambda: ops.attention_with_kvcache(
            qd, kc, vc, lens, randn(2, 1, 2, 4).to("meta"), randn(2, 1, 2, 3)), "k"),
        ("attention_with_kvcache", lambda: snt.attention_with_kvcache(
            qd, kc, vc, lens.to("meta")), "cache_seqlens"),
        ("merge_attention_states", lambda: snt.merge_attention_states(
            out, lse, out.to("meta"), lse.to("meta")), "out_b"),
        ("merge_attention_states", lambda: ops.merge_attention_states(
            torch.stack([out, out]), torch.stack([lse, lse]).to("meta")), "lse_a"),
        ("varlen_attention_forward", lambda: snt.varlen_attention(
            qv, kv.to("meta"), vv, cu_q, cu_k), "k"),
        ("varlen_attention_backward", lambda: ops.varlen_attention_backward(
            randn(6, 2, 3), qv, kv, vv, randn(6, 2, 3), randn(2, 6).to("meta"), cu_q, cu_k,
            0.0, False, None, None), "lse"),
    ]


@pytest.mark.parametrize("case", range(len(_mixed_device_calls())))
def test_mixed_device_types_are_refused_naming_the_arguments(case):
    """As torch's SDPA ("Expected query, key, and value to have the same device type"): a
    ValueError naming the operator and the arguments' devices, not uninitialized memory."""
    what, call, name = _mixed_device_calls()[case]
    with pytest.raises(ValueError, match=rf"{what}: expected .*same device type.*"
                                         rf"\b{name} on meta"):
        call()


def test_host_read_arguments_may_stay_on_the_cpu():
    """The seed (a CPU int64 tensor by the schema), sequence lengths and ALiBi slopes are read
    on the host: on the CPU beside meta tensors they are not a mix (shapes still come)."""
    q, k, v = (torch.empty(1, 2, 5, 4, device="meta"), torch.empty(1, 2, 7, 4, device="meta"),
               torch.empty(1, 2, 7, 3, device="meta"))
    out, _ = ops.attention_forward(q, k, v, None, 0.5, False, None, False,
                                   torch.tensor(3, dtype=torch.int64), None, None, "top_left",
                                   None, torch.rand(2, dtype=torch.float64))
    assert out.device.type == "meta" and out.shape == (1, 2, 5, 3)


def test_sdpafunction_is_a_deprecated_alias():
    q = randn(1, 2, 3, 4)
    with pytest.warns(DeprecationWarning, match="scaled_dot_product_attention"):
        out = snt.SDPAFunction.apply(q, q, q, None, 0.0, True)
    torch.testing.assert_close(out, snt.scaled_dot_product_attention(q, q, q, is_causal=True),
                               rtol=0, atol=0)


# ---------------------------------------------------------------- gradients and dropout


def test_mask_gradient_only_when_asked():
    torch.manual_seed(2)
    q, k, v = (randn(2, 2, 5, 4, requires_grad=True) for _ in range(3))
    fixed = randn(2, 1, 5, 5)
    learned = fixed.clone().requires_grad_()
    snt.scaled_dot_product_attention(q, k, v, fixed).sum().backward()
    assert fixed.grad is None
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    snt.scaled_dot_product_attention(q, k, v, learned).sum().backward()
    for a, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=0, atol=0)
    # the mask's gradient, summed over the head dim it was broadcast along, equals torch's
    ref = fixed.clone().requires_grad_()
    F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), ref).sum().backward()
    assert learned.grad.shape == (2, 1, 5, 5)
    torch.testing.assert_close(learned.grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_seed_is_the_numpy_api_seed():
    """An explicit seed (the whole uint64 range) draws the mask the NumPy API draws."""
    torch.manual_seed(3)
    q, k, v = randn(1, 2, 6, 4), randn(1, 2, 9, 4), randn(1, 2, 9, 3)
    for seed in (0, 12345, 2**63, 2**64 - 1):
        ours = snt.scaled_dot_product_attention(q, k, v, dropout_p=0.4, seed=seed)
        theirs = sdpa_numba.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(),
                                                         dropout_p=0.4, seed=seed)
        np.testing.assert_array_equal(ours.numpy(), theirs)
    with pytest.raises(ValueError, match="seed"):
        snt.scaled_dot_product_attention(q, k, v, dropout_p=0.4, seed=2**64)


def test_dropout_follows_torch_manual_seed_and_replays_in_backward():
    torch.manual_seed(4)
    q, k = randn(1, 2, 6, 4, requires_grad=True), randn(1, 2, 9, 4, requires_grad=True)
    v = torch.eye(9, dtype=torch.float64).expand(1, 2, 9, 9).clone().requires_grad_()
    torch.manual_seed(10)
    a = snt.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    b = snt.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(10)
    c = snt.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert not torch.equal(a, b) and torch.equal(a, c)
    # out = P Z, so dV = outᵀ g exactly when the backward replays the mask; retain_graph:
    # twice, the same
    g = torch.randn_like(a)
    for _ in range(2):
        v.grad = None
        a.backward(g, retain_graph=True)
        torch.testing.assert_close(v.grad, a.detach().transpose(-1, -2) @ g, rtol=1e-12,
                                   atol=1e-12)


# ---------------------------------------------------------------- double backward


def _penalized_grads(attention, q, k, v, mask):
    """Gradients of out.sum() + |d(out²)/dq|²: a gradient penalty, which needs double
    backward (issue 14, class 4: it used to lose its second term silently)."""
    out = attention(q, k, v, mask)
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    return torch.autograd.grad(out.sum() + gq.square().sum(), (q, k, v, mask))


def test_double_backward_matches_torch():
    torch.manual_seed(5)
    q, k, v = (randn(2, 4, 5, 4, requires_grad=True), randn(2, 2, 7, 4, requires_grad=True),
               randn(2, 2, 7, 3, requires_grad=True))
    mask = randn(4, 5, 7, requires_grad=True)
    causal = torch.zeros(5, 7, dtype=torch.float64).masked_fill(
        torch.ones(5, 7, dtype=torch.bool).triu(1), -float("inf"))
    ours = _penalized_grads(lambda q, k, v, m: snt.scaled_dot_product_attention(
        q, k, v, m, is_causal=True, scale=0.3, enable_gqa=True), q, k, v, mask)
    theirs = _penalized_grads(lambda q, k, v, m: F.scaled_dot_product_attention(
        q, k, v, m + causal, scale=0.3, enable_gqa=True), q, k, v, mask)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradgradcheck_with_dropout_and_shared_inputs():
    """Second derivatives by finite differences; q = k = v one tensor; the dropout mask
    replayed by the torch path too (its first-order gradients equal the kernels')."""
    torch.manual_seed(6)
    x = randn(1, 2, 5, 4, requires_grad=True)

    def f(x):
        return snt.scaled_dot_product_attention(x, x, x, dropout_p=0.3, seed=4)

    assert torch.autograd.gradgradcheck(f, (x,))
    (with_graph,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
    (kernels,) = torch.autograd.grad(f(x).sum(), x)
    torch.testing.assert_close(with_graph, kernels, rtol=1e-12, atol=1e-12)


def test_the_backward_operator_itself_is_not_differentiable():
    q, k, v = (randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    out, lse = ops.attention_forward(q, k, v, None, 0.0, False, None, False, None)
    dq = ops.attention_backward(torch.ones_like(out), q, k, v, out, lse, None, 0.0, False,
                                None, False, None, False)[0]
    with pytest.raises(RuntimeError, match="attention_backward is not differentiable"):
        dq.sum().backward()


def test_second_backward_through_a_freed_graph_says_so():
    q, k, v = (randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    loss = snt.scaled_dot_product_attention(q, k, v).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


# ---------------------------------------------------------------- vmap


def test_vmap_forward_with_outer_autograd():
    """The vmapped dim becomes a leading batch dim; an unbatched, lower-rank key broadcasts."""
    torch.manual_seed(6)
    q, k, v, m = randn(4, 2, 5, 4), randn(2, 7, 4), randn(4, 2, 7, 3), randn(4, 5, 7)
    leaves = [[t.clone().requires_grad_() for t in (q, k, v, m)] for _ in range(2)]
    f = lambda q, k, v, m: snt.scaled_dot_product_attention(q, k, v, m, is_causal=True)  # noqa: E731
    outs = [torch.vmap(f, in_dims=(0, None, 0, 0))(*leaves[0]),
            torch.stack([f(leaves[1][0][i], leaves[1][1], leaves[1][2][i], leaves[1][3][i])
                         for i in range(4)])]
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for a, b in zip(*leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-13, atol=1e-13)


def test_vmap_backward_operator():
    torch.manual_seed(7)
    q, k, v, m = randn(3, 2, 5, 4), randn(2, 7, 4), randn(3, 2, 7, 3), randn(3, 5, 7)
    out, lse = torch.vmap(lambda q, v, m: ops.attention_forward(q, k, v, m, 0.0, True, None,
                                                                False, None))(q, v, m)
    go = torch.randn_like(out)
    batched = torch.vmap(lambda go, q, v, o, lse, m: ops.attention_backward(
        go, q, k, v, o, lse, m, 0.0, True, None, False, None, True))(go, q, v, out, lse, m)
    for i in range(3):
        one = ops.attention_backward(go[i], q[i], k, v[i], out[i], lse[i], m[i], 0.0, True,
                                     None, False, None, True)
        for a, b in zip(batched, one):  # dk: per example, not summed over the vmapped dim
            torch.testing.assert_close(a[i], b, rtol=0, atol=0)


def test_vmap_dropout_follows_vmaps_randomness():
    k, v = randn(2, 7, 4), randn(2, 7, 3)
    q = randn(2, 5, 4).expand(3, 2, 5, 4)  # the same query for every vmapped index
    f = lambda q: snt.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # noqa: E731
    with pytest.raises(RuntimeError, match="randomness"):
        torch.vmap(f)(q)
    same = torch.vmap(f, randomness="same")(q)
    assert torch.equal(same[0], same[1]) and torch.equal(same[0], same[2])
    different = torch.vmap(f, randomness="different")(q)
    assert not torch.equal(different[0], different[1])


def test_torch_func_grad_is_refused_clearly():
    q = randn(2, 5, 4)
    with pytest.raises(NotImplementedError, match="torch.func.grad.*torch.autograd.grad"):
        torch.func.grad(lambda q: snt.scaled_dot_product_attention(q, q, q).sum())(q)


# ---------------------------------------------------------------- torch.compile


class Block(torch.nn.Module):
    """A pre-norm transformer block: layernorm, q/k/v projections, attention, output
    projection, MLP."""

    def __init__(self, d=16, heads=2, dropout_p=0.0):
        super().__init__()
        kw = dict(dtype=torch.float64)
        self.heads, self.dropout_p = heads, dropout_p
        self.ln1, self.ln2 = torch.nn.LayerNorm(d, **kw), torch.nn.LayerNorm(d, **kw)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, **kw) for _ in range(4))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d, **kw), torch.nn.GELU(),
                                       torch.nn.Linear(2 * d, d, **kw))

    def forward(self, x, mask):
        b, n, d = x.shape
        h = self.ln1(x)

        def heads(t):
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        y = snt.scaled_dot_product_attention(heads(self.q(h)), heads(self.k(h)),
                                             heads(self.v(h)), mask, is_causal=True,
                                             dropout_p=self.dropout_p)
        x = x + self.o(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


def _run(model, x, mask, seed):
    """Output and gradients (parameters, mask) of one step, dropout drawn after ``seed``."""
    model.zero_grad()
    mask.grad = None
    torch.manual_seed(seed)
    y = model(x, mask)
    y.square().sum().backward()
    return [y.detach()] + [p.grad.clone() for p in model.parameters()] + [mask.grad.clone()]


def test_compile_fullgraph_no_graph_break_same_results():
    """torch.compile(fullgraph=True) on a transformer block with dropout and a learned mask:
    one graph, no break, and outputs and gradients equal eager mode's. (backend="aot_eager":
    it traces the fake kernels and the autograd formula like inductor does, without
    inductor's C++ compile, ~70 s on two cores.)"""
    torch.manual_seed(8)
    model = Block(dropout_p=0.1)
    x = randn(2, 7, 16)
    mask = randn(7, 7, requires_grad=True)
    explain = torch._dynamo.explain(model)(x, mask)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    eager = _run(model, x, mask, seed=9)
    for a, b in zip(_run(compiled, x, mask, seed=9), eager):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # the dropout mask is drawn per call, not baked into the graph
    assert not torch.equal(_run(compiled, x, mask, seed=10)[0], eager[0])
    with torch._dynamo.config.patch(error_on_recompile=True):  # new seeds: no recompile
        _run(compiled, x, mask, seed=11)


def test_compiled_double_backward_is_refused_too():
    """Under torch.compile the backward is AOT autograd's: create_graph=True gives a gradient
    whose own backward raises torch's "does not currently support double backward"."""
    torch.manual_seed(12)
    model = Block()
    x = randn(2, 7, 16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    (g,) = torch.autograd.grad(compiled(x, randn(7, 7)).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.square().sum().backward()
