"""Ring attention (:mod:`sdpa_numba.distributed`) on device arrays, in this process (a
communicator of one rank: the device compute, merges and sums, no messages). The messages
between ranks are tested by tests/test_distributed.py (``mpiexec -n 2`` under the simulator,
host staging). Runs on a real GPU with SDPA_NUMBA_REAL_GPU=1."""

import numpy as np
import pytest
from numba import cuda

pytest.importorskip("mpi4py", reason="ring attention needs mpi4py: pip install -e '.[mpi]'")

from sdpa_numba.distributed import ring_attention, ring_attention_backward  # noqa: E402


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.array_equal(np.isfinite(a), np.isfinite(b))
    same = a == b
    a, b = np.where(same, 0.0, a), np.where(same, 0.0, b)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


@pytest.mark.parametrize("dt, tol, kw", [
    ("float64", 1e-12, dict(is_causal=True, layout="zigzag", enable_gqa=True, window=(2, None),
                            softcap=2.0, sinks="sinks")),
    ("float32", 1e-5, dict(is_causal=False, layout="contiguous")),
])
def test_device_ring_equals_host_ring(rng, dt, tol, kw):
    hq = 4 if kw.get("enable_gqa") else 2
    q = rng.standard_normal((hq, 6, 4)).astype(dt)
    k = rng.standard_normal((2, 6, 4)).astype(dt)
    v = rng.standard_normal((2, 6, 3)).astype(dt)
    if kw.get("sinks") == "sinks":
        kw = {**kw, "sinks": np.r_[-np.inf, rng.standard_normal(hq - 1)]}
    out, lse = ring_attention(q, k, v, return_lse=True, **kw)
    g = rng.standard_normal(out.shape).astype(dt)
    grads = ring_attention_backward(g, q, k, v, out, lse, **kw)
    d = [cuda.to_device(x) for x in (q, k, v, g)]
    out_d, lse_d = ring_attention(*d[:3], return_lse=True, **kw)
    grads_d = ring_attention_backward(d[3], *d[:3], out_d, lse_d, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out_d, lse_d, *grads_d[:3]),
                          (out, lse, *grads[:3])):
        assert not isinstance(a, np.ndarray) and hasattr(a, "copy_to_host"), name  # on device
        a = a.copy_to_host()
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _rel(a, b) <= tol, (name, _rel(a, b))
    if "sinks" in kw:
        assert isinstance(grads_d[3], np.ndarray) and _rel(grads_d[3], grads[3]) <= tol
    assert np.array_equal(d[1].copy_to_host(), k)


def test_bfloat16_device_arrays_are_refused():
    from sdpa_numba._bf16 import bfloat16

    x = cuda.to_device(np.zeros((2, 4, 8), np.float32).astype(bfloat16()))
    with pytest.raises(NotImplementedError, match="bfloat16 CUDA arrays"):
        ring_attention(x, x, x)
