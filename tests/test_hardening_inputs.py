"""Hardening: arguments beyond q, k, v that once gave silent wrong answers.

``out`` sharing memory with an array argument other than the operands (the kernels read it
after writing ``out``), and soft caps at the edge of the compute dtype.
"""

import re

import numpy as np
import pytest
from numba import njit

import sdpa_numba
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import reference, varlen_attention

B, HQ, L, S, E = 1, 3, 5, 7, 8


@njit
def _bias_mod(s, b, h, i, j, bias):
    return s + bias[h]


@njit
def _keep_mod(b, h, i, j, keep):
    return keep[h] != 0


def _qkv(rng, dtype=np.float32):
    return (rng.standard_normal((B, HQ, L, E)).astype(dtype),
            rng.standard_normal((B, HQ, S, E)).astype(dtype),
            rng.standard_normal((B, HQ, S, E)).astype(dtype))


def _out_and_view(n_bytes_view, view_dtype, shape=(B, HQ, L, E), dtype=np.float32):
    """An ``out`` buffer of ``shape`` and an array of ``n_bytes_view`` bytes read as
    ``view_dtype`` in its first bytes (so the two overlap)."""
    out = np.zeros(shape, dtype)
    view = out.reshape(-1).view(np.uint8)[:n_bytes_view].view(view_dtype)
    return out, view


@pytest.mark.parametrize("arg", ["alibi_slopes", "sinks", "mod_args", "mask_mod_args",
                                 "block_mask"])
def test_out_overlapping_a_variant_array_is_refused(rng, arg):
    q, k, v = _qkv(rng)
    out, view = _out_and_view(HQ * 4, np.float32)
    view[:] = 0.5
    kw = {"alibi_slopes": {"alibi_slopes": view}, "sinks": {"sinks": view},
          "mod_args": {"score_mod": _bias_mod, "mod_args": (view,)},
          "mask_mod_args": {"mask_mod": _keep_mod, "mod_args": (view,)}}.get(arg)
    if arg == "block_mask":
        bm = sdpa_numba.create_block_mask(_keep_mod, B, HQ, L, S, mod_args=(np.ones(HQ),))
        out, states = _out_and_view(bm.states.nbytes, np.int8)
        states[:] = bm.states.reshape(-1)
        bm = sdpa_numba.BlockMask(states.reshape(bm.states.shape), bm.mask_mod, bm.B, bm.H,
                                  bm.L, bm.S)
        kw = {"block_mask": bm, "mod_args": (np.ones(HQ),)}
    before = out.copy()
    name = "mod_args[0]" if "mod_args" in arg else arg
    with pytest.raises(ValueError, match="out overlaps " + re.escape(name)):
        sdpa(q, k, v, out=out, **kw)
    assert np.array_equal(out, before)


def test_out_apart_from_variant_arrays_is_taken(rng):
    # The same call with a separate slopes array runs and is right (the check is not a
    # blanket refusal of variants with out).
    q, k, v = _qkv(rng)
    slopes = np.full(HQ, 0.5, np.float32)
    out = np.full((B, HQ, L, E), np.nan, np.float32)
    got = sdpa(q, k, v, out=out, alibi_slopes=slopes)
    assert got is out
    want = sdpa(q, k, v, alibi_slopes=slopes.copy())
    assert np.array_equal(out, want)


@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cu_seqlens_k", "alibi_slopes"])
def test_varlen_out_overlapping_an_argument_is_refused(rng, arg):
    total, hq, e = 6, 2, 4
    q, k, v = (rng.standard_normal((total, hq, e)).astype(np.float32) for _ in range(3))
    out = np.zeros((total, hq, e), np.float32)
    cu = np.array([0, 2, 6], np.int32)
    args = {"cu_seqlens_q": cu, "cu_seqlens_k": cu.copy(), "alibi_slopes": None}
    if arg == "alibi_slopes":
        view = out.reshape(-1)[:hq]
        view[:] = 0.25
    else:
        view = out.reshape(-1).view(np.int32)[:3]
        view[:] = cu
    args[arg] = view
    before = out.copy()
    with pytest.raises(ValueError, match=f"out overlaps {arg}"):
        varlen_attention(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], out=out,
                         alibi_slopes=args["alibi_slopes"])
    assert np.array_equal(out, before)


@pytest.mark.parametrize("arg", ["cache_seqlens", "alibi_slopes", "sinks"])
def test_kvcache_out_overlapping_an_argument_is_refused(rng, arg):
    b, s, h, e = 1, 9, 2, 4
    q = rng.standard_normal((b, 1, h, e)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((b, s, h, e)).astype(np.float32) for _ in range(2))
    out = np.zeros((b, 1, h, e), np.float32)
    args = {"cache_seqlens": np.array([5], np.int32), "alibi_slopes": None, "sinks": None}
    if arg == "cache_seqlens":
        view = out.reshape(-1).view(np.int32)[:1]
        view[:] = 5
    else:
        view = out.reshape(-1)[:h]
        view[:] = 0.25
    args[arg] = view
    before = out.copy()
    with pytest.raises(ValueError, match=f"out overlaps {arg}"):
        sdpa_numba.attention_with_kvcache(q, k_cache, v_cache, args["cache_seqlens"],
                                          out=out, alibi_slopes=args["alibi_slopes"],
                                          sinks=args["sinks"])
    assert np.array_equal(out, before)


@pytest.mark.parametrize("dtype,cap", [(np.float32, 1e-39), (np.float32, 2e-39),
                                       (np.float64, 1e-310), (np.float16, 1e-39)])
def test_softcap_whose_reciprocal_overflows_is_refused(rng, dtype, cap):
    q, k, v = _qkv(rng, dtype)
    with pytest.raises(ValueError, match="softcap"):
        sdpa(q, k, v, softcap=cap)


def test_smallest_softcap_taken_is_exact(rng):
    # The smallest cap the check lets through still gives torch's answer (scores capped to
    # about +-cap: every softmax weight nearly equal).
    q, k, v = _qkv(rng)
    cap = 1 / float(np.finfo(np.float32).max) * 1.01
    got = sdpa(q, k, v, softcap=cap)
    want = reference.attention(q.astype(np.float64), k.astype(np.float64),
                               v.astype(np.float64), softcap=cap)[0]
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_read_only_slopes_and_sinks_compile_nothing_new(rng):
    # Writeability is part of a Numba array's type: read-only ALiBi slopes or sinks (a
    # broadcast, a frozen array) must reach the kernels as the writeable ones do, not as a
    # second specialization; the caller's arrays keep their flags.
    import sys

    cpu_forward = sys.modules["sdpa_numba.cpu.forward"]  # the module (the package's name is the kernel)

    q = rng.standard_normal((1, 3, 5, 8))
    k = rng.standard_normal((1, 3, 7, 8))
    slopes = rng.random(3)
    sinks = rng.standard_normal(3)
    want = sdpa(q, k, k, alibi_slopes=slopes, sinks=sinks)
    before = len(cpu_forward.forward.overloads)
    frozen_slopes, frozen_sinks = slopes.copy(), sinks.copy()
    frozen_slopes.flags.writeable = False
    frozen_sinks.flags.writeable = False
    got = sdpa(q, k, k, alibi_slopes=frozen_slopes, sinks=frozen_sinks)
    got_bcast = sdpa(q, k, k, alibi_slopes=np.broadcast_to(slopes, (1, 3)), sinks=sinks)
    assert len(cpu_forward.forward.overloads) == before
    assert np.array_equal(got, want) and np.array_equal(got_bcast, want)
    assert not frozen_slopes.flags.writeable and not frozen_sinks.flags.writeable
