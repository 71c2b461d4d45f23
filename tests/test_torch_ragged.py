"""Mixed ragged batches through the PyTorch operators: ``block_table`` / ``seqused_k`` on
``sdpa_numba.torch.varlen_attention`` (forward and autograd) and ``cu_seqlens_q`` on
``sdpa_numba.torch.attention_with_kvcache`` (appending and read-only operators): bit for bit
the NumPy-level API's results, opcheck (schemas, fake kernels, autograd registration), and
the refusals. float32, the kernels tests/test_ragged_paged.py compiles."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sdpa_numba  # noqa: E402
import sdpa_numba.torch as snt  # noqa: E402

ops = torch.ops.sdpa_numba
HQ, H, E, PS = 4, 2, 8, 4
LQ = [1, 4, 0, 3]
USED = [5, 9, 3, 7]


def _cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def _paged(seed):
    """Packed queries and a shuffled paged cache (garbage in the unused slots)."""
    g = torch.Generator().manual_seed(seed)
    n = [-(-u // PS) for u in USED]
    q = torch.randn(sum(LQ), HQ, E, generator=g)
    kc, vc = (torch.randn(sum(n) + 2, PS, H, E, generator=g) for _ in range(2))
    order = torch.randperm(sum(n) + 2, generator=g)
    table = torch.zeros(len(USED), max(n), dtype=torch.int32)
    at = 0
    for b, m in enumerate(n):
        table[b, :m] = order[at:at + m]
        at += m
    return q, kc, vc, table, torch.tensor(USED, dtype=torch.int64)


def test_varlen_block_table_op_and_gradients_equal_numpy_api():
    q, kc, vc, table, used = _paged(1)
    kw = dict(is_causal=True, alignment="bottom_right")
    leaves = [t.clone().requires_grad_(True) for t in (q, kc, vc)]
    out, lse = snt.varlen_attention(*leaves, _cu(LQ), None, block_table=table, seqused_k=used,
                                    return_lse=True, **kw)
    arrays = [t.numpy() for t in (q, kc, vc)]
    want, want_lse = sdpa_numba.varlen_attention(*arrays, _cu(LQ).numpy(), None,
                                                 block_table=table.numpy(),
                                                 seqused_k=used.numpy(), return_lse=True, **kw)
    assert out.detach().numpy().tobytes() == want.tobytes()
    assert lse.numpy().tobytes() == want_lse.tobytes()
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(grad)
    grads = sdpa_numba.varlen_attention_backward(grad.numpy(), *arrays, want, want_lse,
                                                 _cu(LQ).numpy(), None, block_table=table.numpy(),
                                                 seqused_k=used.numpy(), **kw)
    for leaf, g in zip(leaves, grads):
        assert leaf.grad.shape == leaf.shape
        assert leaf.grad.numpy().tobytes() == g.tobytes()
    with pytest.raises(NotImplementedError, match="double backward"):
        out, = (snt.varlen_attention(*leaves, _cu(LQ), None, block_table=table,
                                     seqused_k=used, **kw),)
        torch.autograd.grad(out, leaves[0], grad, create_graph=True)


def test_varlen_block_table_opcheck_and_refusals():
    q, kc, vc, table, used = _paged(3)
    q, kc, vc = (t.requires_grad_(True) for t in (q, kc, vc))
    torch.library.opcheck(ops.varlen_attention_forward.default,
                          (q, kc, vc, _cu(LQ), None, None, None, 0.0, False, None, None),
                          kwargs=dict(block_table=table, seqused_k=used))
    with pytest.raises(TypeError, match="cu_seqlens_k is required without block_table"):
        snt.varlen_attention(q, kc[:, 0], vc[:, 0], _cu(LQ))
    with pytest.raises(TypeError, match="block_table must be an integer tensor"):
        snt.varlen_attention(q, kc, vc, _cu(LQ), None, block_table=table.float(),
                             seqused_k=used)
    with pytest.raises(ValueError, match="seqused_k must be >= 0"):
        snt.varlen_attention(q, kc, vc, _cu(LQ), None, block_table=table,
                             seqused_k=-used)


def _ragged_step(seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([3, 0, 5, 2], dtype=torch.int32)
    q = torch.randn(sum(LQ), HQ, E, generator=g)
    kc, vc = (torch.randn(len(LQ), 16, H, E, generator=g) for _ in range(2))
    k, v = (torch.randn(sum(LQ), H, E, generator=g) for _ in range(2))
    return q, kc, vc, lens, k, v


def test_kvcache_cu_seqlens_q_op_equals_numpy_api():
    q, kc, vc, lens, k, v = _ragged_step(4)
    nkc, nvc = kc.numpy().copy(), vc.numpy().copy()
    out, lse = snt.attention_with_kvcache(q, kc, vc, lens, k=k, v=v, cu_seqlens_q=_cu(LQ),
                                          return_lse=True)
    want, want_lse = sdpa_numba.attention_with_kvcache(
        q.numpy(), nkc, nvc, lens.numpy(), k=k.numpy(), v=v.numpy(),
        cu_seqlens_q=_cu(LQ).numpy(), return_lse=True)
    assert out.shape == (sum(LQ), HQ, E) and lse.shape == (HQ, sum(LQ))
    assert out.numpy().tobytes() == want.tobytes() and lse.numpy().tobytes() == want_lse.tobytes()
    assert kc.numpy().tobytes() == nkc.tobytes() and vc.numpy().tobytes() == nvc.tobytes()
    # Read only, with an int cache_seqlens (one per sequence of cu_seqlens_q), through the
    # dispatcher (a fake-tensor trace): the read operator's schema and fake kernel.
    read = snt.attention_with_kvcache(q, kc, vc, 6, cu_seqlens_q=_cu(LQ))
    want = sdpa_numba.attention_with_kvcache(q.numpy(), nkc, nvc, 6,
                                             cu_seqlens_q=_cu(LQ).numpy())
    assert read.numpy().tobytes() == want.tobytes()
    torch.library.opcheck(ops.attention_with_kvcache_read.default, (q, kc, vc, lens + 4),
                          kwargs=dict(cu_seqlens_q=_cu(LQ)))
    torch.library.opcheck(ops.attention_with_kvcache.default, (q, kc, vc, lens, k, v),
                          kwargs=dict(cu_seqlens_q=_cu(LQ)),
                          test_utils=("test_schema", "test_faketensor"))


def test_kvcache_cu_seqlens_q_refused_nothing_written():
    q, kc, vc, lens, k, v = _ragged_step(5)
    before = kc.clone()
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer tensor"):
        snt.attention_with_kvcache(q, kc, vc, lens, k=k, v=v, cu_seqlens_q=_cu(LQ).float())
    with pytest.raises(ValueError, match="cu_seqlens_q must end at"):
        snt.attention_with_kvcache(q, kc, vc, lens, k=k, v=v, cu_seqlens_q=_cu([1, 4, 0, 2]))
    assert torch.equal(kc, before)
    with pytest.raises(NotImplementedError, match="under torch.vmap takes no"):
        torch.vmap(lambda qq: snt.attention_with_kvcache(qq, kc, vc, lens,
                                                         cu_seqlens_q=_cu(LQ)))(q[None])
