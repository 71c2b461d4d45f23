"""Batch invariance: a request's output and lse are bitwise the same whichever other requests
share its batch, wherever it sits in the batch, however its cache is laid out (contiguous, or
shuffled pages of 1, 16 or 64 keys) and whatever the thread count (docs/usage.md, "Limits and
guarantees").

Each test computes one request alone (one thread, contiguous) as the reference, then in
batches of 1 to 16 with other requests of random lengths and contents, at every position, and
asserts equal bytes. The shapes are few and small (H 2, Hq 4, E = Ev = 64) so that few
specializations compile; the batches still cross the sizes at which the kernels switch from
the calling thread to the parallel launch (asserted), so both kernels meet.
"""

import ml_dtypes
import numba
import numpy as np
import pytest

from sdpa_numba import (attention_with_kvcache, merge_attention_states,
                        scaled_dot_product_attention, varlen_attention)
from sdpa_numba.cpu import launch_decode, launch_merge

H, HQ, E = 2, 4, 64
BF16 = np.dtype(ml_dtypes.bfloat16)
SIZES = range(1, 17)
THREADS = (1, 2)
PAGE_SIZES = (None, 1, 16, 64)  # None: contiguous


def _threads(n):
    if numba.config.NUMBA_NUM_THREADS < n:
        pytest.skip(f"needs {n} threads")
    numba.set_num_threads(n)


@pytest.fixture(autouse=True)
def _restore_threads():
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


def _same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), what


def _randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _placements():
    """(n, pos, threads, page_size): every batch size and every position in it, with the
    pairs of a thread count and a layout taken in turn (each pair meets every size from 8)."""
    pairs = [(t, ps) for t in THREADS for ps in PAGE_SIZES]
    k = 0
    for n in SIZES:
        for pos in range(n):
            yield (n, pos, *pairs[k % len(pairs)])
            k += 1


def _cache(rng, ks, vs, page_size, dtype, room=0):
    """``(k_cache, v_cache, block_table)`` holding the requests' keys ``ks[b] (n_b, H, E)``,
    with ``room`` free slots after each: contiguous (``page_size`` None; S_max padded by a
    random amount) or in shuffled pages (spare pages in between; the table's unused entries
    random). Slots no request holds are NaN: a read of one would show."""
    lens = [len(k) + room for k in ks]
    if page_size is None:
        s_max = max(lens) + int(rng.integers(0, 40))
        kc = np.full((len(ks), s_max, H, E), np.nan, dtype)
        vc = np.full((len(ks), s_max, H, E), np.nan, dtype)
        for b, (k, v) in enumerate(zip(ks, vs)):
            kc[b, :len(k)] = k
            vc[b, :len(v)] = v
        return kc, vc, None
    need = [-(-n // page_size) for n in lens]
    n_pages = sum(need) + 3
    order = rng.permutation(n_pages)
    kc = np.full((n_pages, page_size, H, E), np.nan, dtype)
    vc = np.full((n_pages, page_size, H, E), np.nan, dtype)
    table = rng.integers(0, n_pages, (len(ks), max(need) + 1)).astype(np.int32)
    used = 0
    for b, (k, v) in enumerate(zip(ks, vs)):
        pages = order[used:used + need[b]]
        used += need[b]
        table[b, :need[b]] = pages
        full = len(k) // page_size  # whole pages, then the last one's first keys
        kc[pages[:full]] = k[:full * page_size].reshape(full, page_size, H, E)
        vc[pages[:full]] = v[:full * page_size].reshape(full, page_size, H, E)
        if len(k) > full * page_size:
            kc[pages[full], :len(k) - full * page_size] = k[full * page_size:]
            vc[pages[full], :len(v) - full * page_size] = v[full * page_size:]
    return kc, vc, table


@pytest.mark.parametrize("dtype, lq, append", [(np.float32, 1, False), (np.float32, 3, True),
                                               (BF16, 1, False)])
def test_kvcache_request_is_batch_invariant(rng, dtype, lq, append):
    # 1300 keys: three chunks of split-KV, merged by lse. The others' keys: slices of a pool
    # of random lengths, up to 1.5 MiB of keys and values each: the larger batches read more
    # than SERIAL_BYTES.
    n_t = 1300
    longest = (1536 << 10) // (H * 2 * E * np.dtype(dtype).itemsize)
    q_t = _randn(rng, (lq, HQ, E), dtype)
    k_t = _randn(rng, (n_t, H, E), dtype)
    v_t = _randn(rng, (n_t, H, E), dtype)
    pool_k = _randn(rng, (2 * longest, H, E), dtype)
    pool_v = _randn(rng, (2 * longest, H, E), dtype)

    def run(qs, ks, vs, page_size):
        """out, lse of the batch (requests ``qs[b]``, keys ``ks[b]``, values ``vs[b]``)."""
        old_k = [k[:len(k) - lq] if append else k for k in ks]
        old_v = [v[:len(v) - lq] if append else v for v in vs]
        kc, vc, table = _cache(rng, old_k, old_v, page_size, dtype, lq if append else 0)
        kw = {}
        if append:
            kw = dict(k=np.stack([k[len(k) - lq:] for k in ks]),
                      v=np.stack([v[len(v) - lq:] for v in vs]))
        seqlens = np.array([len(k) for k in old_k], np.int32)
        return attention_with_kvcache(np.stack(qs), kc, vc, seqlens, block_table=table,
                                      is_causal=True, return_lse=True, **kw)

    _threads(1)
    ref_out, ref_lse = run([q_t], [k_t], [v_t], None)
    assert np.isfinite(ref_out.astype(np.float32)).all()
    kernels = set()
    for n, pos, threads, page_size in _placements():
        lens = rng.integers(lq, longest, n)
        lens[pos] = n_t
        at = rng.integers(0, longest, n)
        qs = list(_randn(rng, (n, lq, HQ, E), dtype))
        ks = [pool_k[a:a + m] for a, m in zip(at, lens)]
        vs = [pool_v[a:a + m] for a, m in zip(at, lens)]
        qs[pos], ks[pos], vs[pos] = q_t, k_t, v_t
        kernels.add(int(lens.sum()) * H * 2 * E * np.dtype(dtype).itemsize
                    >= launch_decode.SERIAL_BYTES)
        _threads(threads)
        out, lse = run(qs, ks, vs, page_size)
        what = f"n={n} pos={pos} threads={threads} page_size={page_size}"
        _same(out[pos], ref_out[0], what)
        _same(lse[pos], ref_lse[0], what)
    # The reference ran on the calling thread (n_t keys), some batches on the parallel kernel.
    assert n_t * H * 2 * E * np.dtype(dtype).itemsize < launch_decode.SERIAL_BYTES
    assert kernels == {False, True}


@pytest.mark.parametrize("causal", [False, True])
def test_dense_request_is_batch_invariant(rng, causal):
    L, S = 157, 203  # odd; a batch of 1 splits its rows into chunks, one of 16 does not
    q_t = _randn(rng, (HQ, L, E), np.float32)
    k_t = _randn(rng, (H, S, E), np.float32)
    v_t = _randn(rng, (H, S, E), np.float32)

    def run(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                            return_lse=True)

    _threads(1)
    ref_out, ref_lse = run(q_t[None], k_t[None], v_t[None])
    for n, pos, threads, _ in _placements():
        q = _randn(rng, (n, HQ, L, E), np.float32)
        k = _randn(rng, (n, H, S, E), np.float32)
        v = _randn(rng, (n, H, S, E), np.float32)
        q[pos], k[pos], v[pos] = q_t, k_t, v_t
        _threads(threads)
        out, lse = run(q, k, v)
        _same(out[pos], ref_out[0], f"n={n} pos={pos} threads={threads}")
        _same(lse[pos], ref_lse[0], f"n={n} pos={pos} threads={threads}")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_request_is_batch_invariant(rng, causal):
    lq_t, lk_t = 141, 233
    q_t = _randn(rng, (lq_t, HQ, E), np.float32)
    k_t = _randn(rng, (lk_t, H, E), np.float32)
    v_t = _randn(rng, (lk_t, H, E), np.float32)

    def run(qs, ks, vs):
        cu_q = np.cumsum([0] + [len(x) for x in qs])
        cu_k = np.cumsum([0] + [len(x) for x in ks])
        out, lse = varlen_attention(np.concatenate(qs), np.concatenate(ks),
                                    np.concatenate(vs), cu_q, cu_k, is_causal=causal,
                                    return_lse=True)
        return out, lse, cu_q

    _threads(1)
    ref_out, ref_lse, _ = run([q_t], [k_t], [v_t])
    for n, pos, threads, _ in _placements():
        lq = rng.integers(0, 300, n)
        lk = lq + rng.integers(0, 100, n)  # causal sequences see their keys
        qs = [_randn(rng, (m, HQ, E), np.float32) for m in lq]
        ks = [_randn(rng, (m, H, E), np.float32) for m in lk]
        vs = [_randn(rng, (m, H, E), np.float32) for m in lk]
        qs[pos], ks[pos], vs[pos] = q_t, k_t, v_t
        _threads(threads)
        out, lse, cu_q = run(qs, ks, vs)
        rows = slice(cu_q[pos], cu_q[pos + 1])
        _same(out[rows], ref_out, f"n={n} pos={pos} threads={threads}")
        _same(np.ascontiguousarray(lse[:, rows]), ref_lse, f"n={n} pos={pos} threads={threads}")


@pytest.mark.parametrize("form", ["two", "many"])
def test_merge_request_is_batch_invariant(rng, form):
    L, parts = 139, 3
    rows = HQ * L

    def states(n):
        outs = _randn(rng, (parts, n, HQ, L, E), np.float32)
        lses = _randn(rng, (parts, n, HQ, L), np.float32) * 4
        lses[rng.random(lses.shape) < 0.05] = -np.inf  # parts that saw no key
        return outs, lses

    def run(outs, lses):
        if form == "two":
            return merge_attention_states(outs[0], lses[0], outs[1], lses[1])
        return merge_attention_states(outs, lses)

    _threads(1)
    outs_t, lses_t = states(1)
    ref_out, ref_lse = run(outs_t, lses_t)
    kernels = set()
    for n, pos, threads, _ in _placements():
        outs, lses = states(n)
        outs[:, pos], lses[:, pos] = outs_t[:, 0], lses_t[:, 0]
        # merge's size rule, as for decode: some of these run on the parallel kernel
        kernels.add((2 if form == "two" else parts) * n * rows * E * 4
                    >= launch_merge.PARALLEL_BYTES)
        _threads(threads)
        out, lse = run(outs, lses)
        _same(out[pos], ref_out[0], f"n={n} pos={pos} threads={threads}")
        _same(lse[pos], ref_lse[0], f"n={n} pos={pos} threads={threads}")
    assert kernels == {False, True}
