"""The threading layer a fresh install runs on: TBB (the ``tbb`` wheel is a dependency),
which is fork-safe, thread-safe and runs nested parallel calls.

Under ``workqueue`` (the fork-safe layer without TBB), a user's ``@njit(parallel=True)``
function calling ``sdpa_numba.cpu.forward`` inside its ``prange`` aborted the process
("Nested parallel kernel launch detected"). Each check runs in a fresh interpreter without
the caller's NUMBA_* settings (see ``test_hardening_env.run_python``), so it sees the layer
that importing sdpa_numba picks.
"""

from test_hardening_env import THREADS_SCRIPT, _fork_pool, ok, run_python


def test_fresh_install_picks_tbb():
    out = ok(run_python("""
        import numba
        import numpy as np
        import sdpa_numba

        q = np.ones((1, 2, 9, 8), np.float32)
        sdpa_numba.scaled_dot_product_attention(q, q, q)
        print(numba.threading_layer())
    """))
    assert out.strip() == "tbb", ("a fresh install (pip install sdpa_numba, with its tbb "
                                  f"dependency) runs on TBB; this one runs on {out.strip()}")


def test_nested_prange_calling_the_parallel_forward():
    out = ok(run_python("""
        import numba
        import numpy as np
        from numba import njit, prange
        import sdpa_numba
        import sdpa_numba.cpu

        @njit(parallel=True)
        def per_batch(q, k, v, out, lse):
            for b in prange(q.shape[0]):
                sdpa_numba.cpu.forward(q[b:b + 1], k[b:b + 1], v[b:b + 1], None, False, 0.25,
                                       out[b:b + 1], lse[b:b + 1])

        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((4, 2, 70, 16)).astype(np.float32) for _ in range(3))
        out = np.full(q.shape, np.nan, np.float32)
        lse = np.full(q.shape[:3], np.nan, np.float32)
        per_batch(q, k, v, out, lse)
        want = sdpa_numba.scaled_dot_product_attention(q, k, v, scale=0.25)
        print(numba.threading_layer(), np.array_equal(out, want))
    """, timeout=300))
    assert out.strip() == "tbb True"


def test_fork_after_use_on_the_default_layer(tmp_path):
    # The fork pool of test_hardening_env, on the layer picked here (asserted above: TBB).
    assert ok(_fork_pool(tmp_path)).strip() == "SAME"


def test_eight_python_threads_on_the_default_layer():
    out = ok(run_python(THREADS_SCRIPT, timeout=300))
    assert out.strip() == "tbb bad 0"
