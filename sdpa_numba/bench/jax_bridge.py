"""The JAX bridge timed: :func:`sdpa_numba.jax.scaled_dot_product_attention` under ``jax.jit``
against ``jax.nn.dot_product_attention`` (``implementation=None`` and ``"xla"``) and against
the NumPy API on the same arrays, forward and forward+backward, side by side in one process
(the median of interleaved rounds).

Run: ``python -m sdpa_numba.bench.jax_bridge [--B 1 --H 8 --L 2048 --D 64 --rounds 7]``.
Needs JAX; a benchmark, not a test (the machine's load shows in its figures).
"""

import argparse

import numpy as np

from .decode import median_after_idle
from .timing import PAUSE, set_threads


def run(B=1, H=8, L=2048, D=64, rounds=7, causal=False, threads=None):
    """``{(direction, implementation): median seconds}`` for float32 inputs of shape
    ``(B, H, L, D)``."""
    set_threads(threads, torch_too=False)
    import jax
    import jax.numpy as jnp

    import sdpa_numba
    from sdpa_numba.jax import scaled_dot_product_attention as ours

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D)).astype(np.float32) for _ in range(3))
    w = rng.standard_normal((B, H, L, D)).astype(np.float32)
    jq, jk, jv, jw = (jnp.asarray(x) for x in (q, k, v, w))
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  (jax.nn's layout is (B, L, H, D))

    def nn(impl):
        return lambda q, k, v: t(jax.nn.dot_product_attention(t(q), t(k), t(v),
                                                              is_causal=causal,
                                                              implementation=impl))

    impls = {"sdpa_numba.jax": lambda q, k, v: ours(q, k, v, is_causal=causal),
             "jax.nn (None)": nn(None), "jax.nn (xla)": nn("xla")}
    fns = {}
    for name, f in impls.items():
        fwd = jax.jit(f)
        grad = jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * jw),
                                argnums=(0, 1, 2)))
        fns["forward", name] = lambda fwd=fwd: fwd(jq, jk, jv).block_until_ready()
        fns["forward+backward", name] = lambda grad=grad: jax.block_until_ready(
            grad(jq, jk, jv))
    fns["forward", "NumPy API"] = lambda: sdpa_numba.scaled_dot_product_attention(
        q, k, v, is_causal=causal, return_lse=True)

    def numpy_fwd_bwd():
        out, lse = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                           return_lse=True)
        sdpa_numba.scaled_dot_product_attention_backward(w, q, k, v, out, lse,
                                                         is_causal=causal)

    fns["forward+backward", "NumPy API"] = numpy_fwd_bwd
    for fn in fns.values():  # warm-up: compiles
        fn()
    return median_after_idle(fns, rounds, PAUSE)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("B", 1), ("H", 8), ("L", 2048), ("D", 64), ("rounds", 7)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    times = run(a.B, a.H, a.L, a.D, a.rounds, a.causal, a.threads)
    import numba

    print(f"B{a.B} H{a.H} L{a.L} D{a.D} float32{' causal' if a.causal else ''}, "
          f"{numba.get_num_threads()} Numba threads, median of {a.rounds} rounds")
    for direction in ("forward", "forward+backward"):
        base = times[direction, "sdpa_numba.jax"]
        for (d, name), s in times.items():
            if d == direction:
                print(f"{direction:17s} {name:15s} {s * 1e3:9.1f} ms  {s / base:5.2f}x "
                      f"sdpa_numba.jax's time")


if __name__ == "__main__":
    main()
