"""The JAX bridge timed: :func:`sdpa_numba.jax.scaled_dot_product_attention` under ``jax.jit``
against ``jax.nn.dot_product_attention`` (``implementation=None`` and ``"xla"``) and against
the NumPy API on the same arrays, forward and forward+backward, side by side in one process
(the median of interleaved rounds): the wall time of a call and the CPU time the process spent
in it (all its threads). The CPU time shows what the bridge adds (the jitted call and the NumPy
call run the same kernel on the same threads) even on a loaded machine, where the wall times
move by tens of percent from round to round.

Run: ``python -m sdpa_numba.bench.jax_bridge [--B 1 --H 8 --L 2048 --D 64 --rounds 7]``.
Needs JAX; a benchmark, not a test (the machine's load shows in its figures).
"""

import argparse
import statistics
import time

import numpy as np

from .timing import PAUSE, set_threads


def _medians(fns, rounds, idle):
    """``{name: (wall, cpu)}``: the median wall time of a call of each callable and the
    median CPU time of the process during it (``time.process_time``: every thread's), calls
    interleaved, each after ``idle`` seconds of rest."""
    times = {name: ([], []) for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(idle)
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            t1, c1 = time.perf_counter(), time.process_time()
            times[name][0].append(t1 - t0)
            times[name][1].append(c1 - c0)
    return {name: (statistics.median(w), statistics.median(c))
            for name, (w, c) in times.items()}


def run(B=1, H=8, L=2048, D=64, rounds=7, causal=False, threads=None):
    """``{(direction, implementation): (median wall seconds, median CPU seconds)}`` for
    float32 inputs of shape ``(B, H, L, D)``."""
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
    return _medians(fns, rounds, PAUSE)


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
    print(f"{'':33s} {'wall':>9s} {'':29s} {'CPU':>9s}")
    for direction in ("forward", "forward+backward"):
        base, base_cpu = times[direction, "sdpa_numba.jax"]
        for (d, name), (s, c) in times.items():
            if d == direction:
                print(f"{direction:17s} {name:15s} {s * 1e3:9.1f} ms  {s / base:5.2f}x "
                      f"sdpa_numba.jax's time  {c * 1e3:9.1f} ms  {c / base_cpu:5.2f}x")


if __name__ == "__main__":
    main()
