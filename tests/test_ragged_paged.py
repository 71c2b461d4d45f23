"""Mixed, ragged batches over a cache (issue 31, item 5): ``varlen_attention`` with
``block_table`` / ``seqused_k`` and ``attention_with_kvcache`` with ``cu_seqlens_q``, both one
launch of the CPU decode kernel with the rows placed by a run-time table.

Against the float64 reference per sequence (the keys gathered from the pages), bit for bit
against one call per sequence where the docs promise it, and refused (nothing written) on bad
input. Compile cost: the decode kernel's float32 plain recipe (serial, and parallel for the
one large case, shared with tests/test_kvcache.py) and one recipe with a window, soft cap
and ALiBi.
"""

import numpy as np
import pytest

import sdpa_numba
from sdpa_numba import attention_with_kvcache, reference, varlen_attention

HQ, H, E = 6, 2, 40
# One decode row, a chunk of 5 prefill rows, one of 17, and (last) a sequence without rows.
LQ = [1, 5, 17, 0]
USED = [37, 20, 60, 9]
TOL = dict(rtol=2e-5, atol=2e-6)


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _paged(rng, used, page_size, ev=E, extra=3, dtype=np.float32):
    """A shuffled paged cache holding ``used[b]`` keys per sequence (and garbage elsewhere),
    its block table and the keys gathered per sequence."""
    n = [max(1, -(-u // page_size)) for u in used]
    width = max(n) + 1  # one unused column of garbage entries
    n_pages = sum(n) + extra
    kc = rng.standard_normal((n_pages, page_size, H, E)).astype(dtype)
    vc = rng.standard_normal((n_pages, page_size, H, ev)).astype(dtype)
    order = rng.permutation(n_pages)
    table = np.full((len(used), width), 10 ** 6, np.int32)  # out of range where unused
    at = 0
    for b, m in enumerate(n):
        table[b, :m] = order[at:at + m]
        at += m
    return kc, vc, table


def _gather(cache, table, b, n):
    ps = cache.shape[1]
    j = np.arange(n)
    return cache[table[b, j // ps], j % ps]  # (n, H, D)


def _reference(q, cu, keys, values, **kw):
    """Per sequence: the float64 reference over its gathered keys; (out, lse) packed."""
    total, hq, _ = q.shape
    out = np.zeros((total, hq, values[0].shape[-1]))
    lse = np.full((hq, total), -np.inf)
    for b in range(len(cu) - 1):
        r0, r1 = cu[b], cu[b + 1]
        if r1 == r0:
            continue
        o, l = reference.attention(q[r0:r1].transpose(1, 0, 2).astype(np.float64),
                                   keys[b].transpose(1, 0, 2).astype(np.float64),
                                   values[b].transpose(1, 0, 2).astype(np.float64),
                                   enable_gqa=True, **kw)
        out[r0:r1] = o.transpose(1, 0, 2)
        lse[:, r0:r1] = l
    return out, lse


def _alibi_kw(kw, n_seq):
    if kw.get("alibi_slopes") == "per_seq":
        kw = dict(kw, alibi_slopes=np.linspace(0.05, 0.4, n_seq * HQ).reshape(n_seq, HQ)
                  .astype(np.float32))
    return kw


CASES = {
    "causal_bottom_right": dict(is_causal=True, alignment="bottom_right"),
    "causal_top_left": dict(is_causal=True),
    "full": dict(),
    "window_softcap_alibi": dict(is_causal=True, alignment="bottom_right", window=(11, 0),
                                 softcap=4.0, alibi_slopes="per_seq"),
}


@pytest.mark.parametrize("page_size", [16, 7])
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_block_table_against_reference(rng, page_size, case):
    kw = _alibi_kw(CASES[case], len(LQ))
    cu = _cu(LQ)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    kc, vc, table = _paged(rng, USED, page_size)
    used = np.array(USED, np.int32)
    out = np.full((cu[-1], HQ, E), np.nan, np.float32)
    got, lse = varlen_attention(q, kc, vc, cu, block_table=table, seqused_k=used, out=out,
                                return_lse=True, **kw)
    assert got is out
    keys = [_gather(kc, table, b, u) for b, u in enumerate(USED)]
    values = [_gather(vc, table, b, u) for b, u in enumerate(USED)]
    ref_kw = {k: v for k, v in kw.items() if k != "alibi_slopes"}
    if "alibi_slopes" in kw:
        # per sequence: its row of slopes
        outs = []
        for b in range(len(LQ)):
            one = _reference(q[cu[b]:cu[b + 1]], _cu([LQ[b]]), [keys[b]], [values[b]],
                             alibi_slopes=kw["alibi_slopes"][b].astype(np.float64), **ref_kw)
            outs.append(one)
        ref_out = np.concatenate([o for o, _ in outs])
        ref_lse = np.concatenate([l for _, l in outs], axis=1)
    else:
        ref_out, ref_lse = _reference(q, cu, keys, values, **ref_kw)
    np.testing.assert_allclose(got, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    assert lse.shape == (HQ, cu[-1])


def test_varlen_block_table_equals_kvcache_ragged_and_per_request(rng):
    """Bottom-right causal: the varlen call, the ragged kvcache call and one kvcache call per
    request give the same bits."""
    cu = _cu(LQ)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    kc, vc, table = _paged(rng, USED, 16)
    used = np.array(USED, np.int64)
    a, la = varlen_attention(q, kc, vc, cu, block_table=table, seqused_k=used, is_causal=True,
                             alignment="bottom_right", return_lse=True)
    b_, lb = attention_with_kvcache(q, kc, vc, used, block_table=table, cu_seqlens_q=cu,
                                    return_lse=True)
    np.testing.assert_array_equal(a, b_)
    np.testing.assert_array_equal(la, lb)
    for b in range(len(LQ)):
        o, l = attention_with_kvcache(q[None, cu[b]:cu[b + 1]], kc, vc, used[b:b + 1],
                                      block_table=table[b:b + 1], return_lse=True)
        np.testing.assert_array_equal(o[0], a[cu[b]:cu[b + 1]])
        np.testing.assert_array_equal(l[0], la[:, cu[b]:cu[b + 1]])


def test_varlen_cu_seqlens_k_gives_lengths_with_block_table(rng):
    """FlashAttention 2's paged varlen: cu_seqlens_k's lengths, no seqused_k."""
    cu = _cu(LQ)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    kc, vc, table = _paged(rng, USED, 7)
    used = np.array(USED, np.int32)
    a = varlen_attention(q, kc, vc, cu, _cu(USED), block_table=table, is_causal=True)
    b_ = varlen_attention(q, kc, vc, cu, block_table=table, seqused_k=used, is_causal=True)
    np.testing.assert_array_equal(a, b_)
    # seqused_k within cu_seqlens_k's lengths: the first keys only
    fewer = used - np.array([3, 0, 7, 9])
    c = varlen_attention(q, kc, vc, cu, _cu(USED), block_table=table, seqused_k=fewer)
    keys = [_gather(kc, table, b, u) for b, u in enumerate(fewer)]
    values = [_gather(vc, table, b, u) for b, u in enumerate(fewer)]
    np.testing.assert_allclose(c, _reference(q, cu, keys, values)[0], **TOL)


@pytest.mark.parametrize("lengths", [[40, 22, 63, 9], [40, 24, 64, 16]])  # gcd 1 and 8
def test_varlen_seqused_k_without_block_table(rng, lengths):
    """Packed keys: each sequence's first seqused_k[b] of its range of k, read in place."""
    cu, cu_k = _cu(LQ), _cu(lengths)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], H, E)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], H, 24)).astype(np.float32)
    used = np.array(USED, np.int64)
    got, lse = varlen_attention(q, k, v, cu, cu_k, seqused_k=used, is_causal=True,
                                alignment="bottom_right", return_lse=True)
    keys = [k[cu_k[b]:cu_k[b] + u] for b, u in enumerate(USED)]
    values = [v[cu_k[b]:cu_k[b] + u] for b, u in enumerate(USED)]
    ref_out, ref_lse = _reference(q, cu, keys, values, is_causal=True,
                                  alignment="bottom_right")
    np.testing.assert_allclose(got, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    # seqused_k = the full lengths: the varlen call without it, to rounding
    full = varlen_attention(q, k, v, cu, cu_k, seqused_k=np.diff(cu_k), is_causal=True)
    plain = varlen_attention(q, k, v, cu, cu_k, is_causal=True)
    np.testing.assert_allclose(full, plain, **TOL)


@pytest.mark.parametrize("page_size", [16, 7, None])
def test_kvcache_ragged_append_equals_per_request(rng, page_size):
    """A mixed batch with appends: the same bits (output, lse, caches) as one call per
    request, and the reference over the caches after the append."""
    lq = [1, 5, 17, 0, 3]
    lens = np.array([36, 15, 43, 9, 0])
    cu = _cu(lq)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    k = rng.standard_normal((cu[-1], H, E)).astype(np.float32)
    v = rng.standard_normal((cu[-1], H, E)).astype(np.float32)
    if page_size is None:
        kc = rng.standard_normal((len(lq), 64, H, E)).astype(np.float32)
        vc = rng.standard_normal((len(lq), 64, H, E)).astype(np.float32)
        table = None
        kw = {}
    else:
        kc, vc, table = _paged(rng, list(lens + np.array(lq)), page_size)
        kw = dict(block_table=table)
    kc1, vc1 = kc.copy(), vc.copy()
    out = np.full((cu[-1], HQ, E), np.nan, np.float32)
    got, lse = attention_with_kvcache(q, kc, vc, lens, k=k, v=v, cu_seqlens_q=cu, out=out,
                                      return_lse=True, **kw)
    assert got is out
    for b in range(len(lq)):
        r = slice(cu[b], cu[b + 1])
        kwb = dict(block_table=table[b:b + 1]) if table is not None else {}
        kcb, vcb = (kc1, vc1) if table is not None else (kc1[b:b + 1], vc1[b:b + 1])
        o, l = attention_with_kvcache(q[None, r], kcb, vcb, lens[b:b + 1], k=k[None, r],
                                      v=v[None, r], return_lse=True, **kwb)
        np.testing.assert_array_equal(o[0], got[r])
        np.testing.assert_array_equal(l[0], lse[:, r])
    np.testing.assert_array_equal(kc, kc1)
    np.testing.assert_array_equal(vc, vc1)
    n = lens + np.array(lq)
    if table is None:
        keys = [kc[b, :n[b]] for b in range(len(lq))]
        values = [vc[b, :n[b]] for b in range(len(lq))]
    else:
        keys = [_gather(kc, table, b, n[b]) for b in range(len(lq))]
        values = [_gather(vc, table, b, n[b]) for b in range(len(lq))]
    ref_out, ref_lse = _reference(q, cu, keys, values, is_causal=True,
                                  alignment="bottom_right")
    np.testing.assert_allclose(got, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)


def test_kvcache_ragged_plan_runs_layers(rng):
    """kvcache_plan with cu_seqlens_q: each layer's run equals the one-shot call."""
    cu = _cu(LQ)
    lens = np.array(USED)
    kc, vc, table = _paged(rng, USED, 16)
    plan = sdpa_numba.kvcache_plan(np.zeros((cu[-1], HQ, E), np.float32), kc, vc, lens,
                                   block_table=table, cu_seqlens_q=cu)
    assert "ragged (4 sequences)" in repr(plan)
    for _ in range(2):
        q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
        np.testing.assert_array_equal(
            plan.run(q, kc, vc),
            attention_with_kvcache(q, kc, vc, lens, block_table=table, cu_seqlens_q=cu))


def test_ragged_split_kv_and_parallel_kernel(rng):
    """Long sequences: several chunks of keys (split-KV) and, past 8 MiB of keys, the
    parallel kernel; against the reference, and the varlen and kvcache calls alike."""
    lq = [1, 17, 3]
    used = [2600, 3100, 1300]  # 8.5 MiB of float32 keys and values
    cu = _cu(lq)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    kc, vc, table = _paged(rng, used, 16)
    got, lse = varlen_attention(q, kc, vc, cu, block_table=table, seqused_k=np.array(used),
                                is_causal=True, alignment="bottom_right", return_lse=True)
    keys = [_gather(kc, table, b, u) for b, u in enumerate(used)]
    values = [_gather(vc, table, b, u) for b, u in enumerate(used)]
    ref_out, ref_lse = _reference(q, cu, keys, values, is_causal=True,
                                  alignment="bottom_right")
    np.testing.assert_allclose(got, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    kv = attention_with_kvcache(q, kc, vc, np.array(used), block_table=table, cu_seqlens_q=cu)
    np.testing.assert_array_equal(kv, got)
    # each request alone runs on the calling thread (under 8 MiB): the same bits
    for b in range(len(lq)):
        one = attention_with_kvcache(q[None, cu[b]:cu[b + 1]], kc, vc, np.array(used[b:b + 1]),
                                     block_table=table[b:b + 1])
        np.testing.assert_array_equal(one[0], got[cu[b]:cu[b + 1]])


# --- refused: nothing written -------------------------------------------------------------

def _varlen_args(rng):
    cu = _cu(LQ)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    kc, vc, table = _paged(rng, USED, 16)
    return dict(q=q, k=kc, v=vc, cu_seqlens_q=cu, block_table=table,
                seqused_k=np.array(USED, np.int32))


BAD_VARLEN = {
    "cu_seqlens_q decreasing": (dict(cu_seqlens_q=np.array([0, 1, 6, 5, 23])), ValueError,
                                "cu_seqlens_q must not decrease"),
    "cu_seqlens_q total": (dict(cu_seqlens_q=np.array([0, 1, 6, 22, 22])), ValueError,
                           "cu_seqlens_q must end at"),
    "cu_seqlens_q float": (dict(cu_seqlens_q=np.array([0., 1, 6, 23, 23])), TypeError,
                           "cu_seqlens_q must be an integer"),
    "seqused_k beyond pages": (dict(seqused_k=np.array([37, 20, 200, 9])), ValueError,
                               r"seqused_k\[2\] = 200 is beyond"),
    "seqused_k negative": (dict(seqused_k=np.array([37, -1, 60, 9])), ValueError,
                           "seqused_k must be >= 0"),
    "seqused_k shape": (dict(seqused_k=np.array([37, 20, 60])), ValueError,
                        r"seqused_k must have shape \(B,\)"),
    "block_table entry": (dict(block_table="bad_entry"), ValueError,
                          "block_table has entry"),
    "block_table rows": (dict(block_table="bad_rows"), ValueError,
                         "block_table must have q's batch size"),
    "k not paged": (dict(k="packed"), ValueError, r"k must have 4 dims"),
    "seqused_k over cu_seqlens_k": (dict(cu_seqlens_k=_cu([37, 20, 59, 9])), ValueError,
                                    r"seqused_k\[2\] = 60 is more than"),
    "no lengths": (dict(seqused_k=None), ValueError, "block_table needs the keys"),
    "dropout": (dict(dropout_p=0.1), NotImplementedError, "dropout_p > 0"),
}


@pytest.mark.parametrize("name", list(BAD_VARLEN))
def test_varlen_over_cache_refused(rng, name):
    args = _varlen_args(rng)
    change, exc, match = BAD_VARLEN[name]
    change = dict(change)
    if change.get("block_table") == "bad_entry":
        t = args["block_table"].copy()
        t[1, 0] = args["k"].shape[0]
        change["block_table"] = t
    elif change.get("block_table") == "bad_rows":
        change["block_table"] = args["block_table"][:3]
    if change.get("k") == "packed":
        change["k"] = args["k"].reshape(-1, H, E)
    args.update(change)
    out = np.full((args["q"].shape[0], HQ, E), 7.0, np.float32)
    kc0 = args["k"].copy()
    with pytest.raises(exc, match=match):
        varlen_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu_seqlens_q"),
                         out=out, **args)
    assert (out == 7.0).all()
    np.testing.assert_array_equal(change.get("k", kc0), kc0)


def test_varlen_seqused_k_without_block_table_refused(rng):
    q = rng.standard_normal((6, HQ, E)).astype(np.float32)
    k = rng.standard_normal((10, H, E)).astype(np.float32)
    out = np.full((6, HQ, E), 7.0, np.float32)
    with pytest.raises(ValueError, match="cu_seqlens_k is required"):
        varlen_attention(q, k, k, _cu([1, 5]), seqused_k=np.array([3, 4]), out=out)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 7 is more than"):
        varlen_attention(q, k, k, _cu([1, 5]), _cu([4, 6]), seqused_k=np.array([3, 7]),
                         out=out)
    with pytest.raises(ValueError, match=r"k's last dim must be contiguous"):
        varlen_attention(q, np.zeros((10, H, 2 * E), np.float32)[..., ::2], k, _cu([1, 5]),
                         _cu([4, 6]), seqused_k=np.array([3, 4]), out=out)
    assert (out == 7.0).all()


@pytest.mark.parametrize("share", [False, True])
def test_varlen_backward_over_cache_against_reference(rng, share):
    """The backward over a shuffled paged cache: each sequence's gradients against the
    float64 reference over its gathered keys, scattered to their slots (summed where two
    sequences share pages; zero in slots nobody reads, which hold garbage keys)."""
    kw = dict(is_causal=True, alignment="bottom_right", sinks=np.linspace(-1, 1, HQ)
              .astype(np.float32))
    a = _varlen_args(rng)
    table = a["block_table"].copy()
    used = np.array(USED)
    if share:  # sequence 1 reads the first pages of sequence 2 (a shared prefix)
        table[1, :2] = table[2, :2]
    out, lse = varlen_attention(a["q"], a["k"], a["v"], a["cu_seqlens_q"], block_table=table,
                                seqused_k=used, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv, dsinks = sdpa_numba.varlen_attention_backward(
        dout, a["q"], a["k"], a["v"], out, lse, a["cu_seqlens_q"], None, block_table=table,
        seqused_k=used, **kw)
    assert dk.shape == a["k"].shape and dv.shape == a["v"].shape
    cu = a["cu_seqlens_q"]
    want_dk = np.zeros(a["k"].shape)
    want_dv = np.zeros(a["v"].shape)
    want_dsinks = np.zeros(HQ)
    ps = a["k"].shape[1]
    for b in range(len(used)):
        r0, r1 = cu[b], cu[b + 1]
        if r1 == r0:
            continue
        kb, vb = (_gather(x, table, b, used[b]).transpose(1, 0, 2).astype(np.float64)
                  for x in (a["k"], a["v"]))
        gq, gk, gv, _, gs = reference.attention_backward(
            dout[r0:r1].transpose(1, 0, 2).astype(np.float64),
            a["q"][r0:r1].transpose(1, 0, 2).astype(np.float64), kb, vb, enable_gqa=True,
            **kw)
        np.testing.assert_allclose(dq[r0:r1], gq.transpose(1, 0, 2), rtol=1e-4, atol=2e-5)
        j = np.arange(used[b])
        np.add.at(want_dk, (table[b, j // ps], j % ps), gk.transpose(1, 0, 2))
        np.add.at(want_dv, (table[b, j // ps], j % ps), gv.transpose(1, 0, 2))
        want_dsinks += gs
    np.testing.assert_allclose(dk, want_dk, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(dv, want_dv, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(dsinks, want_dsinks, rtol=1e-4, atol=2e-5)


def test_varlen_backward_seqused_k_packed_and_refusals(rng):
    """seqused_k without pages: the gradients of the keys each sequence reads, zero for the
    rest of its range; bitwise those of the packed backward over the used keys alone.
    Dropout and CUDA arrays are refused."""
    lq, lk, use = [3, 4], [8, 6], np.array([5, 6])
    q = rng.standard_normal((sum(lq), HQ, E)).astype(np.float32)
    k = rng.standard_normal((sum(lk), H, E)).astype(np.float32)
    v = rng.standard_normal((sum(lk), H, E)).astype(np.float32)
    out, lse = varlen_attention(q, k, v, _cu(lq), _cu(lk), seqused_k=use, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = sdpa_numba.varlen_attention_backward(dout, q, k, v, out, lse, _cu(lq),
                                                      _cu(lk), seqused_k=use)
    keep = np.r_[0:5, 8:14]
    pq, pk, pv = sdpa_numba.varlen_attention_backward(dout, q, k[keep], v[keep], out, lse,
                                                      _cu(lq), _cu(use))
    assert dq.tobytes() == pq.tobytes()
    assert dk[keep].tobytes() == pk.tobytes() and dv[keep].tobytes() == pv.tobytes()
    assert not dk[5:8].any() and not dv[5:8].any()
    with pytest.raises(NotImplementedError, match="dropout_p > 0 with block_table"):
        sdpa_numba.varlen_attention_backward(dout, q, k, v, out, lse, _cu(lq), _cu(lk),
                                             seqused_k=use, dropout_p=0.1, seed=1)
    with pytest.raises(ValueError, match="seqused_k must be >= 0"):
        sdpa_numba.varlen_attention_backward(dout, q, k, v, out, lse, _cu(lq), _cu(lk),
                                             seqused_k=np.array([5, -1]))


def test_kvcache_ragged_refused_nothing_written(rng):
    cu = _cu(LQ)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    lens = np.array([10, 10, 30, 9])
    kc, vc, table = _paged(rng, list(lens + np.array(LQ)), 16)
    k = rng.standard_normal((cu[-1], H, E)).astype(np.float32)
    kc0 = kc.copy()
    out = np.full((cu[-1], HQ, E), 7.0, np.float32)
    bad = [
        (dict(k=k[:-1], v=k[:-1]), ValueError, "with cu_seqlens_q, k and v must have shapes"),
        (dict(cu_seqlens_q=np.array([0, 1, 7, 6, 23])), ValueError, "must not decrease"),
        (dict(cu_seqlens_q=np.array([0, 1, 6, 23])), ValueError,
         r"cache_seqlens must have shape \(3,\)"),
        (dict(q=q[None]), ValueError, r"q must have 3 dims \(total_q, Hq, E\) with cu_seqlens_q"),
        (dict(cache_seqlens=np.array([10, 10, 50, 9])), ValueError, "is beyond the cache"),
        (dict(rotary_cos=np.ones((40, 4)), rotary_sin=np.ones((40, 4))), ValueError,
         "rotary_cos has 40 rows"),
    ]
    for change, exc, match in bad:
        args = dict(q=q, k=k, v=k, cache_seqlens=lens, cu_seqlens_q=cu, block_table=table,
                    out=out)
        args.update(change)
        with pytest.raises(exc, match=match):
            attention_with_kvcache(args.pop("q"), kc, vc, args.pop("cache_seqlens"), **args)
        assert (out == 7.0).all()
        np.testing.assert_array_equal(kc, kc0)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_kvcache_ragged_quantized_append_equals_per_request(rng, fmt):
    """An 8-bit cache (int8 with per-token scales, or fp8 with a descale per sequence and
    head): the ragged call with appends gives the bits of one call per request, results and
    caches."""
    lq = [1, 5, 0, 3]
    lens = np.array([20, 7, 4, 0])
    cu = _cu(lq)
    ps = 16
    n_pages = 8
    table = rng.permutation(n_pages)[:8].reshape(4, 2).astype(np.int32)
    if fmt == "int8":
        kc = rng.integers(-127, 128, (n_pages, ps, H, E)).astype(np.int8)
        vc = rng.integers(-127, 128, (n_pages, ps, H, E)).astype(np.int8)
        ks = rng.uniform(0.01, 0.02, (n_pages, ps, H)).astype(np.float32)
        vs = rng.uniform(0.01, 0.02, (n_pages, ps, H)).astype(np.float32)
    else:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        kc = rng.standard_normal((n_pages, ps, H, E)).astype(ml_dtypes.float8_e4m3fn)
        vc = rng.standard_normal((n_pages, ps, H, E)).astype(ml_dtypes.float8_e4m3fn)
        ks = rng.uniform(0.5, 2, (len(lq), H)).astype(np.float32)
        vs = rng.uniform(0.5, 2, (len(lq), H)).astype(np.float32)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    k = rng.standard_normal((cu[-1], H, E)).astype(np.float32)
    v = rng.standard_normal((cu[-1], H, E)).astype(np.float32)
    caches = [x.copy() for x in (kc, vc, ks, vs)]
    got = attention_with_kvcache(q, kc, vc, lens, k=k, v=v, block_table=table,
                                 cu_seqlens_q=cu, k_scale=ks, v_scale=vs)
    kc1, vc1, ks1, vs1 = caches
    for b in range(len(lq)):
        r = slice(cu[b], cu[b + 1])
        sc = dict(k_scale=ks1, v_scale=vs1) if fmt == "int8" else dict(
            k_scale=ks1[b:b + 1], v_scale=vs1[b:b + 1])
        o = attention_with_kvcache(q[None, r], kc1, vc1, lens[b:b + 1], k=k[None, r],
                                   v=v[None, r], block_table=table[b:b + 1], **sc)
        np.testing.assert_array_equal(o[0], got[r])
    for x, y in zip((kc, vc, ks, vs), (kc1, vc1, ks1, vs1)):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("is_causal", [True, False])
def test_kvcache_ragged_rotary_equals_per_request(rng, is_causal):
    """Rotary embedding on append in a ragged batch: each token at its own position (all of
    a sequence's query tokens at cache_seqlens[b] when not causal), as one call per
    request."""
    lq = [1, 5, 0, 3]
    lens = np.array([20, 7, 4, 0])
    cu = _cu(lq)
    cos = rng.standard_normal((40, 8))
    sin = rng.standard_normal((40, 8))
    kc, vc, table = _paged(rng, list(lens + np.array(lq)), 16)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    k = rng.standard_normal((cu[-1], H, E)).astype(np.float32)
    v = rng.standard_normal((cu[-1], H, E)).astype(np.float32)
    kc1, vc1 = kc.copy(), vc.copy()
    got = attention_with_kvcache(q, kc, vc, lens, k=k, v=v, block_table=table, cu_seqlens_q=cu,
                                 rotary_cos=cos, rotary_sin=sin, is_causal=is_causal)
    for b in range(len(lq)):
        r = slice(cu[b], cu[b + 1])
        o = attention_with_kvcache(q[None, r], kc1, vc1, lens[b:b + 1], k=k[None, r],
                                   v=v[None, r], block_table=table[b:b + 1], rotary_cos=cos,
                                   rotary_sin=sin, is_causal=is_causal)
        np.testing.assert_array_equal(o[0], got[r])
    np.testing.assert_array_equal(kc, kc1)
