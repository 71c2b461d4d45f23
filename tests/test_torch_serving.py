"""The serving functions as PyTorch operators: ``torch.ops.sdpa_numba.attention_with_kvcache``
and ``torch.ops.sdpa_numba.merge_attention_states`` (sdpa_numba.torch).

Eager results are compared bitwise with the NumPy-level functions (the same kernels on the same
bits), the cache append is checked visible to the caller, opcheck checks the schemas (mutation
declared), fake kernels and autograd registration, and one torch.compile(fullgraph=True) decode
step checks that the operators trace with no graph break. float64 mostly, to share the kernels
other tests compile."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sdpa_numba  # noqa: E402
import sdpa_numba.torch as snt  # noqa: E402
from sdpa_numba.reference import attention as reference  # noqa: E402

ops = torch.ops.sdpa_numba


def randn(g, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=dtype)


def kv_problem(seed, B=3, Lq=1, Hq=6, H=2, E=8, Ev=5, S=13, new=1, dtype=torch.float64):
    """q, caches (poisoned past the sequences: NaN would show if read), new k/v, lengths."""
    g = torch.Generator().manual_seed(seed)
    q = randn(g, B, Lq, Hq, E, dtype=dtype)
    k_cache, v_cache = randn(g, B, S, H, E, dtype=dtype), randn(g, B, S, H, Ev, dtype=dtype)
    lens = torch.tensor([3, 9, 0][:B] + [5] * (B - 3), dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        k_cache[b, n + new:] = float("nan")
        v_cache[b, n + new:] = float("nan")
    k, v = randn(g, B, new, H, E, dtype=dtype), randn(g, B, new, H, Ev, dtype=dtype)
    return q, k_cache, v_cache, k, v, lens


# ---------------------------------------------------------------- attention_with_kvcache


@pytest.mark.parametrize("is_causal, Lq, new", [(True, 1, 1), (True, 3, 3), (False, 2, 0)])
def test_kvcache_equals_numpy_api_and_appends(is_causal, Lq, new):
    """Bitwise the NumPy API's result and lse; the appended keys and values are in the
    caller's caches afterwards (and nothing else of them changed)."""
    q, k_cache, v_cache, k, v, lens = kv_problem(1, Lq=Lq, new=new)
    kn, vn = k_cache.numpy().copy(), v_cache.numpy().copy()
    kw = dict(k=k, v=v) if new else {}
    out, lse = snt.attention_with_kvcache(q, k_cache, v_cache, lens, is_causal=is_causal,
                                          scale=0.3, return_lse=True, **kw)
    want, want_lse = sdpa_numba.attention_with_kvcache(
        q.numpy(), kn, vn, lens.numpy(), is_causal=is_causal, scale=0.3, return_lse=True,
        **{n: x.numpy() for n, x in kw.items()})
    assert out.shape == (3, Lq, 6, 5) and out.dtype == torch.float64 and out.is_contiguous()
    assert lse.shape == (3, 6, Lq) and lse.dtype == torch.float64
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    # the caller's caches hold what the NumPy API wrote into its copies (NaN where unwritten)
    np.testing.assert_array_equal(k_cache.numpy(), kn)
    np.testing.assert_array_equal(v_cache.numpy(), vn)
    if new:
        for b, n in enumerate(lens.tolist()):
            assert torch.equal(k_cache[b, n:n + new], k[b])
            assert torch.equal(v_cache[b, n:n + new], v[b])
    # and against the float64 reference: token t of sequence b sees its keys up to n - Lq + t
    kv_lens = lens + new
    for b in range(3):
        n = int(kv_lens[b])
        mask = (np.arange(n)[None, :] <= n - Lq + np.arange(Lq)[:, None]) if is_causal else None
        kb = k_cache[b, :n].numpy().repeat(3, axis=1).transpose(1, 0, 2)
        vb = v_cache[b, :n].numpy().repeat(3, axis=1).transpose(1, 0, 2)
        if n == 0:
            assert not out[b].any()
            continue
        ref, _ = reference(q[b].numpy().transpose(1, 0, 2), kb, vb, attn_mask=mask, scale=0.3)
        np.testing.assert_allclose(out[b].numpy().transpose(1, 0, 2), ref, rtol=1e-12,
                                   atol=1e-12)


def test_kvcache_paged_float32_and_int_seqlens():
    """A paged cache through block_table, float32, and cache_seqlens given as an int."""
    g = torch.Generator().manual_seed(2)
    q = randn(g, 2, 1, 4, 8, dtype=torch.float32)
    k_pages, v_pages = randn(g, 5, 3, 2, 8, dtype=torch.float32), randn(g, 5, 3, 2, 8,
                                                                         dtype=torch.float32)
    table = torch.tensor([[4, 0, 2], [1, 3, 2]], dtype=torch.int32)  # page 2: read by both
    out = snt.attention_with_kvcache(q, k_pages, v_pages, 7, block_table=table)
    want = sdpa_numba.attention_with_kvcache(q.numpy(), k_pages.numpy(), v_pages.numpy(), 7,
                                             block_table=table.numpy())
    np.testing.assert_array_equal(out.numpy(), want)


def test_kvcache_strided_cache_views():
    """transformers' (B, H, S, D) cache viewed as (B, S, H, D): a transpose, no copy."""
    g = torch.Generator().manual_seed(3)
    key, value = randn(g, 2, 2, 11, 8), randn(g, 2, 2, 11, 8)
    q = randn(g, 2, 1, 4, 8)
    out = snt.attention_with_kvcache(q, key.transpose(1, 2), value.transpose(1, 2), 11,
                                     is_causal=False)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), key, value, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_kvcache_variants_are_passed_by_their_api_names(monkeypatch):
    """The variants reach the NumPy-level API under its keywords (window as a pair), and only
    those given; cache_leftpad as an integer array; the results are the API's, bitwise."""
    from sdpa_numba.torch import serving

    seen = []
    real = serving._kvcache

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(serving, "_kvcache", spy)
    q, k_cache, v_cache, _, _, lens = kv_problem(4, B=2)
    lens = lens[:2]
    slopes, sinks = torch.rand(6, dtype=torch.float64), torch.rand(6, dtype=torch.float64)
    leftpad = torch.tensor([1, 0])
    out = snt.attention_with_kvcache(q, k_cache, v_cache, lens, window=(3, None),
                                     alignment="bottom_right", softcap=2.5,
                                     alibi_slopes=slopes, sinks=sinks, cache_leftpad=leftpad)
    snt.attention_with_kvcache(q, k_cache, v_cache, lens)
    variants, plain = seen
    assert variants["window"] == (3, None) and variants["alignment"] == "bottom_right"
    assert variants["softcap"] == 2.5
    np.testing.assert_array_equal(variants["alibi_slopes"], slopes.numpy())
    np.testing.assert_array_equal(variants["sinks"], sinks.numpy())
    np.testing.assert_array_equal(variants["cache_leftpad"], [1, 0])
    assert not set(plain) & {"window", "alignment", "softcap", "alibi_slopes", "sinks",
                             "cache_leftpad"}
    want = sdpa_numba.attention_with_kvcache(
        q.numpy(), k_cache.numpy(), v_cache.numpy(), lens.numpy(), window=(3, None),
        alignment="bottom_right", softcap=2.5, alibi_slopes=slopes.numpy(),
        sinks=sinks.numpy(), cache_leftpad=leftpad.numpy())
    np.testing.assert_array_equal(out.numpy(), want)


def test_kvcache_errors_leave_the_cache_untouched():
    q, k_cache, v_cache, k, v, lens = kv_problem(5)
    before = k_cache.clone(), v_cache.clone()

    def untouched():  # bitwise, NaN poison included
        return all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(),
                                                                      b.nan_to_num())
                   for a, b in zip(before, (k_cache, v_cache)))

    with pytest.raises(ValueError, match="beyond the cache"):  # an append that overflows
        snt.attention_with_kvcache(q, k_cache, v_cache, lens + 13, k=k, v=v)
    with pytest.raises(TypeError, match="cache_seqlens must be an integer tensor"):
        snt.attention_with_kvcache(q, k_cache, v_cache, lens.double(), k=k, v=v)
    with pytest.raises(TypeError, match="k dtype torch.int64"):
        snt.attention_with_kvcache(q, k_cache, v_cache, lens, k=k.long(), v=v)
    # gradients wanted: refused before anything runs (the operator has no backward)
    with pytest.raises(NotImplementedError, match="q require.*torch.no_grad"):
        snt.attention_with_kvcache(q.requires_grad_(), k_cache, v_cache, lens, k=k, v=v)
    assert untouched()
    with torch.no_grad():  # the same call without grad mode is fine
        snt.attention_with_kvcache(q, k_cache, v_cache, lens, k=k, v=v)
    assert not untouched()


def test_kvcache_opcheck_and_meta():
    """Schema (the caches declared mutated: opcheck fails on an undeclared write), fake kernel
    against the real one, and shapes on meta tensors."""
    q, k_cache, v_cache, k, v, lens = kv_problem(6, Lq=2, new=2)
    torch.library.opcheck(ops.attention_with_kvcache.default,
                          (q, k_cache, v_cache, lens, k, v), {"scale": 0.5},
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_static"))
    torch.library.opcheck(ops.attention_with_kvcache_read.default,
                          (q, k_cache, v_cache, lens + 2), {"is_causal": False},
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_static"))
    meta = [t.to("meta") for t in (q, k_cache, v_cache)]
    for op in (ops.attention_with_kvcache, ops.attention_with_kvcache_read):
        out, lse = op(*meta, lens.to("meta"))
        assert out.shape == (3, 2, 6, 5) and lse.shape == (3, 6, 2)
        assert out.device.type == "meta"


def test_kvcache_compiled_decode_step_no_graph_break():
    """A decode step (project the new token, append it, attend, project out; then attend
    again without appending, the read-only operator) under torch.compile(fullgraph=True): one
    graph, the same output as eager and the same caches (the append survives
    functionalization, and the second call reads the appended cache)."""
    g = torch.Generator().manual_seed(7)
    B, H, Hq, E, S = 2, 2, 4, 8, 9
    wq, wk, wv = randn(g, 16, Hq * E), randn(g, 16, H * E), randn(g, 16, H * E)

    def step(x, k_cache, v_cache, lens):
        q = (x @ wq).view(B, 1, Hq, E)
        k, v = (x @ wk).view(B, 1, H, E), (x @ wv).view(B, 1, H, E)
        out = snt.attention_with_kvcache(q, k_cache, v_cache, lens, k=k, v=v)
        again = snt.attention_with_kvcache(q, k_cache, v_cache, lens + 1, is_causal=False)
        return out.reshape(B, 1, Hq * E).sum(-1), again

    x = randn(g, B, 1, 16)
    caches = randn(g, B, S, H, E), randn(g, B, S, H, E)
    lens = torch.tensor([4, 6], dtype=torch.int32)
    eager_caches = [c.clone() for c in caches]
    want = step(x, *eager_caches, lens)
    explain = torch._dynamo.explain(step)(x, *[c.clone() for c in caches], lens)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(x, *caches, lens)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1].reshape(B, 1, Hq * E).sum(-1), got[0], rtol=1e-12,
                               atol=1e-12)
    for c, e in zip(caches, eager_caches):
        assert torch.equal(c, e)
    assert torch.equal(caches[0][1, 6], (x[1] @ wk).view(H, E))


# ---------------------------------------------------------------- merge_attention_states


def _parts(seed, dtype=torch.float64):
    """Attention over two disjoint halves of the keys, and over all of them."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = randn(g, 2, 3, 5, 8), randn(g, 2, 3, 11, 8), randn(g, 2, 3, 11, 6)
    parts = [snt.attention_forward(q, k[:, :, s], v[:, :, s], None, 0.0, False, None, False,
                                   None) for s in (slice(0, 4), slice(4, 11))]
    whole = snt.attention_forward(q, k, v, None, 0.0, False, None, False, None)
    return [(o.to(dtype), lse) for o, lse in parts], whole


def test_merge_equals_numpy_api_two_and_n_ary():
    (oa, la), (ob, lb) = _parts(8)[0]
    la[0, 1, 2] = -float("inf")  # a part without keys for one row: contributes nothing
    out, lse = snt.merge_attention_states(oa, la, ob, lb)
    want, want_lse = sdpa_numba.merge_attention_states(oa.numpy(), la.numpy(), ob.numpy(),
                                                       lb.numpy())
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    out_n, lse_n = snt.merge_attention_states([oa, ob, oa], [la, lb, torch.full_like(la, -5.0)])
    want, want_lse = sdpa_numba.merge_attention_states(
        np.stack([oa, ob, oa]), np.stack([la, lb, np.full_like(la, -5.0)]))
    np.testing.assert_array_equal(out_n.numpy(), want)
    np.testing.assert_array_equal(lse_n.numpy(), want_lse)


def test_merge_gives_attention_over_the_union():
    parts, (whole, whole_lse) = _parts(9)
    out, lse = snt.merge_attention_states(*parts[0], *parts[1])
    torch.testing.assert_close(out, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-12, atol=1e-12)


def test_merge_gradients():
    """gradcheck of both results, two-part and n-ary forms, with a row that one part has no
    keys for (lse -inf: a zero weight, no NaN)."""
    (oa, la), (ob, lb) = _parts(10)[0]
    la = la.clone()
    la[1, 0, 3] = -float("inf")
    leaves = [t.detach().clone().requires_grad_() for t in (oa, la, ob, lb)]

    def both(*args):
        out, lse = snt.merge_attention_states(*args)
        return out, lse.masked_fill(torch.isinf(lse), 0.0)

    assert torch.autograd.gradcheck(both, leaves)
    stacked = [torch.stack([oa, ob]).requires_grad_(), torch.stack([la, lb]).requires_grad_()]
    assert torch.autograd.gradcheck(both, stacked)
    (d_la,) = torch.autograd.grad(both(*leaves)[0].sum(), leaves[1])
    assert d_la[1, 0, 3] == 0 and torch.isfinite(d_la).all()


def test_merge_opcheck_and_errors():
    (oa, la), (ob, lb) = _parts(11)[0]
    oa, la = oa.requires_grad_(), la.requires_grad_()
    torch.library.opcheck(ops.merge_attention_states.default, (oa, la, ob, lb))
    torch.library.opcheck(ops.merge_attention_states.default,
                          (torch.stack([oa.detach(), ob]), torch.stack([la.detach(), lb])))
    with pytest.raises(TypeError, match="out_b and lse_b go together"):
        snt.merge_attention_states(oa, la, ob)
    with pytest.raises(ValueError, match="lse_b must have shape"):
        snt.merge_attention_states(oa, la, ob, lb[..., :2])
    with pytest.raises(TypeError, match="lse_a must be a float tensor"):
        snt.merge_attention_states(oa, la.long(), ob, lb)


# ---------------------------------------------------------------- vmap


def _paged(cache, page=4):
    """A contiguous cache (B, S, H, D) as pages in reversed order, and its block table."""
    B, S, H, D = cache.shape
    P = -(-S // page)
    pages = torch.full((B, P * page, H, D), float("nan"), dtype=cache.dtype)
    pages[:, :S] = cache
    table = (B * P - 1 - torch.arange(B * P)).view(B, P).to(torch.int32)
    return pages.view(B * P, page, H, D).flip(0).contiguous(), table


def _assert_vmap_equals_loop(f, in_dims, *args):
    batched = torch.vmap(f, in_dims=in_dims)(*args)
    n = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    for i in range(n):
        one = f(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims)))
        for got, want in zip(batched, one):
            assert torch.equal(got[i], want)


def test_vmap_kvcache_read_folds_into_the_batch():
    """The read-only KV-cache operator under vmap equals a Python loop bitwise: batched and
    shared caches, contiguous and paged (the block table offset to each index's pages),
    per-index lengths, batched ALiBi slopes; batched sinks (one call per index)."""
    probs = [kv_problem(s, Lq=2, new=0) for s in range(3)]
    q, kc, vc, _, _, lens = (torch.stack(x) for x in zip(*probs))
    slopes = torch.rand(3, 6, dtype=torch.float64)
    sinks = torch.randn(3, 6, dtype=torch.float64)

    def f(q, kc, vc, lens, slopes):
        return snt.attention_with_kvcache(q, kc, vc, lens, is_causal=False, return_lse=True,
                                          alibi_slopes=slopes)

    _assert_vmap_equals_loop(f, (0, 0, 0, 0, 0), q, kc, vc, lens, slopes)
    _assert_vmap_equals_loop(f, (1, None, None, None, None), q.transpose(0, 1), kc[0], vc[0],
                             lens[0], slopes[0])
    kp, table = zip(*(_paged(c) for c in kc))
    vp = [_paged(c)[0] for c in vc]
    kp, vp, table = torch.stack(kp), torch.stack(vp), torch.stack(table)

    def paged(q, kc, vc, lens, table):
        return snt.attention_with_kvcache(q, kc, vc, lens, block_table=table, return_lse=True)

    _assert_vmap_equals_loop(paged, (0, 0, 0, 0, 0), q, kp, vp, lens, table)
    _assert_vmap_equals_loop(paged, (0, None, None, 0, None), q, kp[0], vp[0], lens, table[0])

    def with_sinks(q, sinks):
        return snt.attention_with_kvcache(q, kc[0], vc[0], lens[0], sinks=sinks,
                                          return_lse=True)

    _assert_vmap_equals_loop(with_sinks, (0, 0), q, sinks)


def test_vmap_kvcache_append_is_refused_clearly():
    q, k_cache, v_cache, k, v, lens = kv_problem(12)
    before = k_cache.clone()
    def f(q, k, v):
        return snt.attention_with_kvcache(q, k_cache, v_cache, lens, k=k, v=v)

    with pytest.raises(NotImplementedError, match="vmap over the appending operator"):
        torch.vmap(f)(*(t.expand(2, *t.shape) for t in (q, k, v)))
    torch.testing.assert_close(k_cache, before, rtol=0, atol=0, equal_nan=True)


def test_vmap_merge_two_and_n_ary_with_outer_autograd():
    """The merge under vmap equals a loop (two parts with one unbatched; n stacked parts
    with the vmapped dim after the parts' dim), and autograd through it equals the loop's."""
    (oa, la), (ob, lb) = _parts(13)[0]
    outs, lses = torch.stack([oa, ob, oa.flip(-1)]), torch.stack([la, lb, la - 1.0])
    leaves = [[t.clone().requires_grad_() for t in (outs, lses)] for _ in range(2)]
    vm = torch.vmap(snt.merge_attention_states, in_dims=(0, 0, None, None))
    _assert_vmap_equals_loop(snt.merge_attention_states, (0, 0, None, None), outs, lses, ob,
                             lb)
    batched = vm(*leaves[0], ob, lb)
    loop = [torch.stack(r) for r in zip(*(snt.merge_attention_states(o, s, ob, lb)
                                          for o, s in zip(*leaves[1])))]
    for results in (batched, loop):
        (results[0].square().sum() + results[1].sum()).backward()
    for a, b in zip(*leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    # n-ary: two stacked parts, vmapped over dim 1
    _assert_vmap_equals_loop(snt.merge_attention_states, (1, 1),
                             torch.stack([outs, outs.flip(0)]), torch.stack([lses, lses.flip(0)]))
