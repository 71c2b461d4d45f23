"""Helpers of the CUDA tests: device copies, strided device views, comparison with the
float64 reference."""

import os

import numpy as np
from numba import cuda

import checks  # tests/checks.py: the measured tolerances
import sdpa_numba
from sdpa_numba import reference
from sdpa_numba.gpu.arrays import as_strided, is_simulated_mode

#: Whether the tests were asked to run on a real GPU (else: on the simulator).
REAL_GPU = os.environ.get("SDPA_NUMBA_REAL_GPU") == "1"
#: Whether numba.cuda is the simulator in this process.
SIMULATED = is_simulated_mode()

#: Relative Frobenius error allowed for each dtype.
TOL = {np.dtype(np.float16): 1e-3, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def torch_cuda():
    """The torch module when the tests run on a real GPU and torch has CUDA, else None."""
    if not REAL_GPU:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def dev(x):
    """A device copy of host array ``x`` (contiguous: views are made on the device)."""
    return None if x is None else cuda.to_device(np.ascontiguousarray(x))


def permuted(d, axes):
    """A device view of ``d`` with its axes permuted, as ``np.transpose`` (no copy)."""
    return as_strided(d, tuple(d.shape[a] for a in axes), tuple(d.strides[a] for a in axes))


def rel_err(x, ref):
    x = np.asarray(x, np.float64)
    den = np.linalg.norm(ref)
    return np.linalg.norm(x - ref) / (den if den else 1.0)


def compare(out, lse, q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """Check a result against the float64 reference computed from the same host inputs."""
    ref_out, ref_lse = reference.attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                           scale=scale, enable_gqa=enable_gqa)
    dtype = np.dtype(q.dtype)
    assert out.dtype == dtype and out.shape == ref_out.shape
    cdt = np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)
    assert lse.dtype == cdt and lse.shape == ref_lse.shape
    assert np.isfinite(out).all() == np.isfinite(ref_out).all()
    assert rel_err(out, ref_out) <= TOL[dtype], rel_err(out, ref_out)
    masked = np.isneginf(ref_lse)
    assert (np.isneginf(lse) == masked).all()
    assert rel_err(lse[~masked], ref_lse[~masked]) <= TOL[cdt]
    if SIMULATED:
        # The simulator's arithmetic is NumPy's, in the compute dtype: the CPU suite's bounds
        # apply (tests/checks.py, measured). A real GPU (fast exp, other sum orders) keeps
        # the looser bounds above.
        assert rel_err(out, ref_out) <= checks.TOL[dtype.type], rel_err(out, ref_out)
        if dtype == np.float16:
            checks.check_f16(out, ref_out, v)
        checks.check_lse(lse, ref_lse, dtype.type)


def run(q, k, v, attn_mask=None, **kw):
    """Attention on device copies of host arrays; returns host ``(out, lse)``."""
    out, lse = sdpa_numba.scaled_dot_product_attention(dev(q), dev(k), dev(v), dev(attn_mask),
                                                       return_lse=True, **kw)
    return out.copy_to_host(), lse.copy_to_host()


def check(q, k, v, attn_mask=None, **kw):
    """Run on the device and compare with the reference; returns host ``(out, lse)``."""
    out, lse = run(q, k, v, attn_mask, **kw)
    compare(out, lse, q, k, v, attn_mask, **kw)
    return out, lse


def small_decode_blocks(monkeypatch, chunk=8):
    """The CUDA decode kernel's launch sizes made tiny (few simulated threads, chunks of
    ``chunk`` keys, row tiles of 4, key blocks of 4), so that small problems still split into
    several chunks, key blocks and row tiles."""
    import sdpa_numba.gpu.decode as gpu_decode

    monkeypatch.setattr(gpu_decode, "THREADS", 8)
    monkeypatch.setattr(gpu_decode, "CHUNK", chunk)
    monkeypatch.setattr(gpu_decode, "ROWS", 4)
    monkeypatch.setattr(gpu_decode, "BN", 4)
