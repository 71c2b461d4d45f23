"""A refused call writes nothing: every public function, given an argument it refuses (a
TypeError or ValueError), leaves all its inputs and buffers bitwise as they were.

Each case snapshots the bytes of every array it passes (operands, ``out`` buffers, caches
that a call would append to, index arrays), makes a call that one argument spoils (checked
late: after the arrays a careless function would already have written), and compares.
Public APIs only.
"""

import numpy as np
import pytest

import sdpa_numba
import sdpa_numba.cpu
from sdpa_numba import (attention_with_kvcache, merge_attention_states,
                        scaled_dot_product_attention, scaled_dot_product_attention_backward,
                        varlen_attention, varlen_attention_backward)

TINY_CAP = 1e-39  # its reciprocal overflows float32: refused


def _bytes(x):
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().contiguous().numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def assert_refused(call, arrays, exc=(TypeError, ValueError)):
    before = [_bytes(a) for a in arrays]
    with pytest.raises(exc):
        call()
    after = [_bytes(a) for a in arrays]
    changed = [n for n, (a, b) in enumerate(zip(before, after)) if a != b]
    assert not changed, f"arrays {changed} were written by a refused call"


def _rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _dense(rng):
    q, k, v = _rand(rng, 2, 3, 5, 8), _rand(rng, 2, 3, 7, 8), _rand(rng, 2, 3, 7, 8)
    out = np.full((2, 3, 5, 8), 7.0, np.float32)
    return q, k, v, out


def test_dense_forward(rng):
    q, k, v, out = _dense(rng)
    assert_refused(lambda: scaled_dot_product_attention(q, k, v, out=out, softcap=TINY_CAP),
                   [q, k, v, out])
    slopes = out.reshape(-1)[:3]  # out overlapping the ALiBi slopes
    assert_refused(lambda: scaled_dot_product_attention(q, k, v, out=out, alibi_slopes=slopes),
                   [q, k, v, out])
    assert_refused(lambda: scaled_dot_product_attention(q, k, v, out=out, seed=-1,
                                                        dropout_p=0.5), [q, k, v, out])


def test_dense_backward(rng):
    q, k, v, out = _dense(rng)
    lse = np.zeros((2, 3, 5), np.float32)
    g = _rand(rng, 2, 3, 5, 8)
    assert_refused(lambda: scaled_dot_product_attention_backward(g, q, k, v, out, lse,
                                                                 softcap=TINY_CAP),
                   [g, q, k, v, out, lse])
    assert_refused(lambda: scaled_dot_product_attention_backward(g, q, k, v, out, lse[..., :4]),
                   [g, q, k, v, out, lse])


def _packed(rng):
    q, k, v = (_rand(rng, 9, 2, 4) for _ in range(3))
    cu = np.array([0, 4, 9], np.int32)
    return q, k, v, cu


def test_varlen(rng):
    q, k, v, cu = _packed(rng)
    out = np.full((9, 2, 4), 7.0, np.float32)
    assert_refused(lambda: varlen_attention(q, k, v, cu, cu, out=out, softcap=TINY_CAP),
                   [q, k, v, cu, out])
    lse = np.zeros((2, 9), np.float32)
    assert_refused(lambda: varlen_attention_backward(out, q, k, v, out, lse, cu, cu,
                                                     softcap=TINY_CAP), [q, k, v, cu, out, lse])


def test_kvcache_append_is_not_done_on_a_refused_call(rng):
    q = _rand(rng, 2, 1, 4, 8)
    kc, vc = _rand(rng, 2, 16, 2, 8), _rand(rng, 2, 16, 2, 8)
    k_new, v_new = _rand(rng, 2, 1, 2, 8), _rand(rng, 2, 1, 2, 8)
    seqlens = np.array([3, 9], np.int32)
    out = np.full((2, 1, 4, 8), 7.0, np.float32)
    arrays = [q, kc, vc, k_new, v_new, seqlens, out]
    assert_refused(lambda: attention_with_kvcache(q, kc, vc, seqlens, k=k_new, v=v_new, out=out,
                                                  softcap=TINY_CAP), arrays)
    assert_refused(lambda: attention_with_kvcache(q, kc, vc, seqlens, k=k_new, v=v_new, out=out,
                                                  window=(-1, 0)), arrays)


def test_merge(rng):
    oa, ob = _rand(rng, 2, 3, 5, 8), _rand(rng, 2, 3, 5, 8)
    la, lb = _rand(rng, 2, 3, 5), _rand(rng, 2, 3, 4)  # lse_b of the wrong shape
    assert_refused(lambda: merge_attention_states(oa, la, ob, lb), [oa, la, ob, lb])


def test_cpu_kernel_entry_point(rng):
    # A float16 array from Python is refused with a TypeError before any kernel runs.
    q = _rand(rng, 1, 2, 5, 8, dtype=np.float16)
    out = np.full((1, 2, 5, 8), 7.0, np.float16)
    lse = np.zeros((1, 2, 5), np.float32)
    assert_refused(lambda: sdpa_numba.cpu.forward(q, q, q, None, False, 0.3, out, lse),
                   [q, out, lse])
    dq, dk, dv = (np.zeros((1, 2, 5, 8), np.float32) for _ in range(3))
    assert_refused(lambda: sdpa_numba.cpu.backward(q, q, q, None, False, 0.3, out, out, lse,
                                                   dq, dk, dv), [q, out, lse, dq, dk, dv])


def test_torch_operators(rng):
    torch = pytest.importorskip("torch")
    import sdpa_numba.torch as st

    q, k, v, out = (torch.from_numpy(x) for x in _dense(rng))
    assert_refused(lambda: st.scaled_dot_product_attention(q, k, v, softcap=TINY_CAP),
                   [q, k, v])
    pq, pk, pv, cu = (torch.from_numpy(x) for x in _packed(rng))
    assert_refused(lambda: st.varlen_attention(pq, pk, pv, cu, cu, softcap=TINY_CAP),
                   [pq, pk, pv, cu])
    kq = torch.from_numpy(_rand(rng, 2, 1, 4, 8))
    kc, vc = (torch.from_numpy(_rand(rng, 2, 16, 2, 8)) for _ in range(2))
    kn, vn = (torch.from_numpy(_rand(rng, 2, 1, 2, 8)) for _ in range(2))
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    assert_refused(lambda: st.attention_with_kvcache(kq, kc, vc, seqlens, k=kn, v=vn,
                                                     softcap=TINY_CAP),
                   [kq, kc, vc, kn, vn, seqlens])
    oa, ob = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    la, lb = torch.randn(2, 3, 5), torch.randn(2, 3, 4)
    assert_refused(lambda: st.merge_attention_states(oa, la, ob, lb), [oa, la, ob, lb])


def test_torch_custom_ops(rng):
    """The registered operators themselves (what torch.compile traces), forward and backward:
    the outputs of an accepted call are the inputs of the refused backward."""
    torch = pytest.importorskip("torch")
    import sdpa_numba.torch as st

    q, k, v, _ = (torch.from_numpy(x) for x in _dense(rng))
    plain = (None, 0.0, False, None, False, None)  # mask, dropout, causal, scale, gqa, seed
    assert_refused(lambda: st.attention_forward(q, k, v, *plain, softcap=TINY_CAP), [q, k, v])
    out, lse = st.attention_forward(q, k, v, *plain)
    g = torch.randn_like(out)
    assert_refused(lambda: st.attention_backward(g, q, k, v, out, lse, *plain, False,
                                                 softcap=TINY_CAP),
                   [g, q, k, v, out, lse])
    pq, pk, pv, cu = (torch.from_numpy(x) for x in _packed(rng))
    vplain = (None, None, 0.0, False, None, None)  # max lengths, dropout, causal, scale, seed
    assert_refused(lambda: st.varlen_attention_forward(pq, pk, pv, cu, cu, *vplain,
                                                       softcap=TINY_CAP),
                   [pq, pk, pv, cu])
    vo, vl = st.varlen_attention_forward(pq, pk, pv, cu, cu, *vplain)
    vg = torch.randn_like(vo)
    assert_refused(lambda: st.varlen_attention_backward(vg, pq, pk, pv, vo, vl, cu, cu,
                                                        *vplain[2:], softcap=TINY_CAP),
                   [vg, pq, pk, pv, vo, vl, cu])
    kq = torch.from_numpy(_rand(rng, 2, 1, 4, 8))
    kc, vc = (torch.from_numpy(_rand(rng, 2, 16, 2, 8)) for _ in range(2))
    kn, vn = (torch.from_numpy(_rand(rng, 2, 1, 2, 8)) for _ in range(2))
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    assert_refused(lambda: st.attention_with_kvcache_op(kq, kc, vc, seqlens, k=kn, v=vn,
                                                        softcap=TINY_CAP),
                   [kq, kc, vc, kn, vn, seqlens])
    assert_refused(lambda: st.attention_with_kvcache_read_op(kq, kc, vc, seqlens,
                                                             softcap=TINY_CAP),
                   [kq, kc, vc, seqlens])
    oa, ob = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    la, lb = torch.randn(2, 3, 5), torch.randn(2, 3, 4)
    assert_refused(lambda: st.merge_attention_states_op(oa, la, ob, lb), [oa, la, ob, lb])


def test_distributed_in_one_process(rng):
    pytest.importorskip("mpi4py")
    from sdpa_numba import distributed

    q, k, v, out = _dense(rng)
    assert_refused(lambda: distributed.ring_attention(q, k, v, softcap=TINY_CAP), [q, k, v])
    lse = np.zeros((2, 3, 5), np.float32)
    assert_refused(lambda: distributed.ring_attention_backward(out, q, k, v, out, lse,
                                                               softcap=TINY_CAP),
                   [q, k, v, out, lse])
    assert_refused(lambda: distributed.shard(q, layout="striped"), [q])
    assert_refused(lambda: distributed.unshard(q, layout="striped"), [q])


def test_cpu_kernel_entry_points_beyond_forward_and_backward(rng):
    # The other jitted entry points that a float16 array from Python reaches (each refused
    # before any kernel runs: from_python.explain_float16), with every buffer snapshotted.
    h = np.float16
    q = _rand(rng, 5, 8, dtype=h)
    out = np.full((5, 8), 7.0, h)
    lse = np.zeros(5, np.float32)
    assert_refused(lambda: sdpa_numba.cpu.forward_head(q, q, q, None, False, 0.3, out, lse),
                   [q, out, lse])
    dq = _rand(rng, 1, 1, 2, 8, dtype=h)
    kc = _rand(rng, 1, 6, 2, 8, dtype=h)
    table = np.zeros((1, 1), np.int32)
    lens = np.array([6], np.int32)
    dout = np.full((1, 1, 2, 8), 7.0, h)
    dlse = np.zeros((1, 2, 1), np.float32)
    for decode in (sdpa_numba.cpu.decode, sdpa_numba.cpu.decode_serial):
        assert_refused(lambda: decode(dq, kc, kc, table, lens, True, 0.3, dout, dlse),
                       [dq, kc, table, lens, dout, dlse])
    pq, pk, pv, cu = _packed(rng)
    pq = pq.astype(h)
    pout = np.full(pq.shape, 7.0, h)
    plse = np.zeros((2, 9), np.float32)
    assert_refused(lambda: sdpa_numba.cpu.varlen_forward(pq, pq, pq, cu, cu, False, 0.3, pout,
                                                         plse), [pq, cu, pout, plse])
    grads = [np.full(pq.shape, 7.0, np.float32) for _ in range(3)]
    assert_refused(lambda: sdpa_numba.cpu.varlen_backward(pq, pq, pq, cu, cu, False, 0.3, pout,
                                                          pout, plse, *grads),
                   [pq, cu, pout, plse, *grads])
