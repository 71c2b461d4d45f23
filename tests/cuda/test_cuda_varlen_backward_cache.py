"""varlen_attention_backward with block_table / seqused_k on CUDA arrays (the simulator unless
SDPA_NUMBA_REAL_GPU=1): the used keys gathered on the device, the packed CUDA backward, the
keys' and values' gradients summed back into their slots by sdpa_numba.gpu.gather's kernels.
Against the CPU's result on the same inputs (pages shared or not, pages of 1 and 3 keys, and
seqused_k without pages); slots no sequence reads are exactly zero. Tiny sizes."""

import numpy as np
import pytest

import sdpa_numba
from sdpa_numba import varlen_attention
from sdpa_cuda_testing import SIMULATED, dev

HQ, H, E = 4, 2, 8
LQ = [1, 3, 0, 2]
USED = [5, 7, 2, 4]


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _paged(rng, page_size, dtype):
    """A shuffled paged cache (garbage in the pages nobody reads) and its block table."""
    n = [max(1, -(-u // page_size)) for u in USED]
    n_pages = sum(n) + 2
    kc = rng.standard_normal((n_pages, page_size, H, E)).astype(dtype)
    vc = rng.standard_normal((n_pages, page_size, H, E - 2)).astype(dtype)
    order = rng.permutation(n_pages)
    table = np.zeros((len(USED), max(n)), np.int32)
    at = 0
    for b, m in enumerate(n):
        table[b, :m] = order[at:at + m]
        at += m
    return kc, vc, table


def _tol(dtype):
    if dtype == np.float64:
        return dict(rtol=1e-11, atol=1e-12)
    return dict(rtol=1e-5 if SIMULATED else 1e-4, atol=1e-6 if SIMULATED else 1e-5)


def _both(rng, q, k, v, cu_q, cu_k=None, **kw):
    """The CPU's and the device's gradients (host copies) on the same forward's out / lse."""
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    cpu = sdpa_numba.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, **kw)
    gpu = sdpa_numba.varlen_attention_backward(dev(dout), dev(q), dev(k), dev(v), dev(out),
                                               dev(lse), cu_q, cu_k, **kw)
    return cpu, tuple(g.copy_to_host() for g in gpu)


@pytest.mark.parametrize("page_size,share,dtype", [
    (3, False, np.float64), (3, True, np.float64), (1, True, np.float64),
    (3, True, np.float32)])
def test_paged_backward_against_the_cpu(rng, page_size, share, dtype):
    kc, vc, table = _paged(rng, page_size, dtype)
    if share:  # sequence 1 reads the first page of sequence 3 (and so, twice, its slots)
        table[1, 0] = table[3, 0]
    cu = _cu(LQ)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(dtype)
    cpu, gpu = _both(rng, q, kc, vc, cu, block_table=table, seqused_k=np.array(USED),
                     is_causal=True, alignment="bottom_right")
    assert [g.shape for g in gpu] == [q.shape, kc.shape, vc.shape]
    assert all(g.dtype == dtype for g in gpu)
    for got, want in zip(gpu, cpu):
        np.testing.assert_allclose(got, want, **_tol(dtype))
    read = np.zeros(kc.shape[:2], bool)
    for b, u in enumerate(USED):
        j = np.arange(u)
        read[table[b, j // page_size], j % page_size] = True
    assert read.sum() < read.size  # spare pages: their gradients are zero, bit for bit
    assert not gpu[1][~read].any() and not gpu[2][~read].any()
    assert gpu[1][read].any()


def test_seqused_k_without_pages_against_the_cpu(rng):
    lq, lk, use = [2, 3], [6, 4], np.array([4, 4])
    q = rng.standard_normal((sum(lq), HQ, E))
    k = rng.standard_normal((sum(lk), H, E))
    v = rng.standard_normal((sum(lk), H, E))
    cpu, gpu = _both(rng, q, k, v, _cu(lq), _cu(lk), seqused_k=use, is_causal=True)
    assert [g.shape for g in gpu] == [q.shape, k.shape, v.shape]
    for got, want in zip(gpu, cpu):
        np.testing.assert_allclose(got, want, **_tol(np.float64))
    assert not gpu[1][4:6].any() and not gpu[2][4:6].any()  # sequence 0's unused keys


def test_refusals_before_any_kernel(rng):
    kc, vc, table = _paged(rng, 3, np.float32)
    cu = _cu(LQ)
    q = rng.standard_normal((cu[-1], HQ, E)).astype(np.float32)
    out, lse = varlen_attention(q, kc, vc, cu, block_table=table, seqused_k=np.array(USED),
                                return_lse=True)
    args = (dev(out), dev(q), dev(kc), dev(vc), dev(out), dev(lse), cu, None)
    with pytest.raises(NotImplementedError, match="dropout_p > 0 with block_table"):
        sdpa_numba.varlen_attention_backward(*args, block_table=table,
                                             seqused_k=np.array(USED), dropout_p=0.1, seed=1)
    with pytest.raises(ValueError, match="seqused_k must be >= 0"):
        sdpa_numba.varlen_attention_backward(*args, block_table=table,
                                             seqused_k=np.array([5, -1, 2, 4]))
    with pytest.raises(TypeError):  # a mix of host and device arrays
        sdpa_numba.varlen_attention_backward(out, dev(q), kc, vc, out, lse, cu, None,
                                             block_table=table, seqused_k=np.array(USED))
