"""varlen_attention and its backward on CUDA arrays (one launch of the dense CUDA kernels over
the whole packed batch, each block finding its sequence in a work list), under the simulator,
against the per-sequence float64 reference (no CPU kernel runs here: nothing to compile for
the CPU)."""

import importlib

import numpy as np
import pytest
from numba import cuda

from sdpa_cuda_testing import dev, rel_err
from sdpa_numba import reference, scaled_dot_product_attention, varlen_attention, \
    varlen_attention_backward
from varlen_checks import (bias_mod, bias_mod_grad, cu, keep_mod, packed, per_sequence,
                           reference_forward, reference_grads)

LQ = [3, 0, 1, 6, 2, 0]
LK = [5, 2, 0, 6, 3, 0]

fw = importlib.import_module("sdpa_numba.gpu.forward")
bw = importlib.import_module("sdpa_numba.gpu.backward")
work = importlib.import_module("sdpa_numba.gpu.work")
launch_varlen = importlib.import_module("sdpa_numba.gpu.launch_varlen")


def _check(rng, ref_forward, lq=LQ, lk=LK, **kw):
    q, k, v = packed(rng, lq, lk, 4, 2, 5, 3)
    g = rng.standard_normal((sum(lq), 4, 3))
    cq, ck = cu(lq), cu(lk)
    out = dev(np.full(g.shape, np.nan))
    res, lse = varlen_attention(dev(q), dev(k), dev(v), cq, dev(ck), out=out, return_lse=True,
                                **kw)
    assert res is out
    res, lse = res.copy_to_host(), lse.copy_to_host()
    ref, ref_lse = ref_forward(q, k, v, cq, ck)
    assert rel_err(res, ref) < 1e-12
    assert np.array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-12)

    grads = varlen_attention_backward(dev(g), dev(q), dev(k), dev(v), dev(res), dev(lse),
                                      cq, ck, **kw)
    want = reference_grads(g, q, k, v, cq, ck, **kw)
    assert len(grads) == (4 if "sinks" in kw else 3)
    for x, y in zip(grads, want):
        x = x if isinstance(x, np.ndarray) else x.copy_to_host()
        assert x.shape == np.shape(y) and rel_err(x, y) < 1e-10


def test_gqa_causal_bottom_right_dropout_and_empty_sequences(rng):
    kw = dict(is_causal=True, alignment="bottom_right", dropout_p=0.25, seed=7)
    _check(rng, lambda *a: per_sequence(reference.attention_dropout, *a, enable_gqa=True,
                                        **kw), **kw)


def test_every_variant_per_sequence(rng):
    n = len(LQ)
    kw = dict(alibi_slopes=rng.random((n, 4)) * 0.3, sinks=np.array([0.5, -np.inf, -1.0, 2.0]),
              score_mod=bias_mod, mask_mod=keep_mod, window=(4, 1),
              mod_args=(rng.standard_normal((n, 4)), np.array([3, 4, 5, 2, 7, 3], np.int64)))
    _check(rng, lambda *a: reference_forward(*a, **kw), score_mod_grad=bias_mod_grad, **kw)


class _Spy:
    """A compiled kernel whose launches are recorded as ``(name, grid size)``."""

    def __init__(self, name, kernel, launches):
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, config):
        self.launches.append((self.name, config[0]))
        return self.kernel[config]


@pytest.fixture
def launches(monkeypatch):
    """The kernel launches of the test, recorded; and every array the varlen launcher
    allocates (out, lse, the gradients) filled with NaN, so that a row no block writes fails."""
    seen = []
    real_fw, real_bw = fw._kernel, bw._kernel
    monkeypatch.setattr(fw, "_kernel", lambda *a: _Spy("forward", real_fw(*a), seen))
    monkeypatch.setattr(bw, "_kernel", lambda which, *a: _Spy(which, real_bw(which, *a), seen))

    def poisoned(shape, dtype):
        return cuda.to_device(np.full(shape, np.nan, dtype))

    monkeypatch.setattr(launch_varlen, "device_array", poisoned)
    return seen


#: 40 short sequences, queries and keys of lengths 0 to 5 (some sequences without queries,
#: some without keys, some without either).
MANY_Q = [2, 0, 5, 1, 3, 0, 4, 1, 5, 2, 0, 3, 1, 4, 2, 5, 0, 1, 3, 2,
          1, 4, 0, 2, 5, 3, 1, 0, 2, 4, 3, 1, 5, 0, 2, 1, 4, 3, 2, 1]
MANY_K = [3, 2, 0, 4, 1, 0, 5, 2, 3, 1, 4, 0, 2, 5, 3, 1, 0, 4, 2, 3,
          5, 1, 2, 0, 4, 2, 3, 1, 5, 0, 2, 4, 1, 3, 0, 2, 5, 1, 3, 4]


def _blocks(lengths, block):
    return sum(-(-n // block) for n in lengths)


def test_one_launch_per_kernel_for_many_sequences(rng, launches):
    """The whole packed batch is one grid: one forward launch, one dQ and one dK/dV launch,
    with no thread block for the missing blocks of short or empty sequences (Hq = 4 query
    heads, H = 2 key/value heads); results per sequence, each in its own frame."""
    kw = dict(is_causal=True, alignment="bottom_right", dropout_p=0.25, seed=11)
    _check(rng, lambda *a: per_sequence(reference.attention_dropout, *a, enable_gqa=True,
                                        **kw), lq=MANY_Q, lk=MANY_K, **kw)
    bm = bn = 4  # the tests' tiny blocks (conftest.TINY)
    assert launches == [("forward", 4 * _blocks(MANY_Q, bm)), ("dq", 4 * _blocks(MANY_Q, bm)),
                        ("dkv", 2 * _blocks(MANY_K, bn))]


def test_many_sequences_top_left_window_alibi_softcap_sinks(rng, launches):
    """Per-sequence ALiBi slopes, a window aligned top-left, a soft cap and sinks over the 40
    sequences, in one launch per kernel."""
    n = len(MANY_Q)
    kw = dict(alibi_slopes=rng.random((n, 4)) * 0.3, window=(2, 1), softcap=3.0,
              sinks=np.array([0.5, -np.inf, -1.0, 2.0]))
    _check(rng, lambda *a: reference_forward(*a, **kw), lq=MANY_Q, lk=MANY_K, **kw)
    assert [name for name, _ in launches] == ["forward", "dq", "dkv"]


def test_varlen_shares_the_dense_compilations(rng):
    """A packed batch runs the dense kernels' compilations (the work list is a run-time
    argument): no new specialization."""
    q, k, v = packed(rng, [3, 1], [2, 4], 2, 2, 5, 3)
    first = [dev(x[:n].transpose(1, 0, 2)) for x, n in ((q, 3), (k, 2), (v, 2))]
    scaled_dot_product_attention(*first, is_causal=True)  # sequence 0, dense
    before = dict(fw._kernels)
    varlen_attention(dev(q), dev(k), dev(v), cu([3, 1]), cu([2, 4]), is_causal=True)
    assert fw._kernels == before


def test_work_list_covers_every_block_once_costliest_first():
    seqs = work.Sequences(cu(MANY_Q).astype(np.int64), cu(MANY_K).astype(np.int64), True)
    no_limit = 1 << 62
    for by_keys, lengths in ((False, MANY_Q), (True, MANY_K)):
        t = work.work_list(seqs, 2, by_keys, 0, no_limit, 0)
        assert t.dtype == np.int64 and t.shape == (_blocks(lengths, 2), work.N_COLUMNS)
        got = sorted((int(r[work.SEQ]), int(r[work.FIRST])) for r in t)
        assert got == [(s, f) for s, n in enumerate(lengths) for f in range(0, n, 2)]
        s = t[:, work.SEQ]
        assert np.array_equal(t[:, work.Q0], cu(MANY_Q)[s])
        assert np.array_equal(t[:, work.K0], cu(MANY_K)[s])
        assert np.array_equal(t[:, work.LQ], np.array(MANY_Q)[s])
        assert np.array_equal(t[:, work.LK], np.array(MANY_K)[s])
        assert np.array_equal(t[:, work.OFFSET], t[:, work.LK] - t[:, work.LQ])
    # causal, bottom-right: a query block's cost is the keys its rows see
    t = work.work_list(work.Sequences(np.array([0, 1, 9]), np.array([0, 8, 16]), True), 4,
                       False, 0, no_limit, 0)
    assert [(int(r[work.SEQ]), int(r[work.FIRST])) for r in t] == [(0, 0), (1, 4), (1, 0)]
    top_left = work.work_list(work.Sequences(np.array([0, 1, 9]), np.array([0, 8, 16]), False),
                              4, False, 3, no_limit, 0)
    assert np.all(top_left[:, work.OFFSET] == 3)
