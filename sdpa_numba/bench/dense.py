"""Timing and comparison of attention implementations, for ``python -m sdpa_numba bench``.

Speed is measured as docs/performance.md describes: every implementation runs on the same inputs in the
same process with the same thread count; each is warmed up first (for sdpa_numba that call
compiles or loads the kernels from Numba's cache, and its time is reported separately), then
sdpa_numba and torch are timed in interleaved rounds and each keeps its minimum; the naive NumPy
floor is timed in rounds of its own afterwards (its BLAS threads, spinning after each call, and
its L x S allocations slowed the next implementation timed, torch most: up to 2x here). FLOPs are
``4·B·H·L·S·E`` for the forward (``Q Kᵀ`` and ``P V``), half of that when causal.

The implementations compared:

* ``sdpa_numba``: :func:`sdpa_numba.scaled_dot_product_attention`;
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors sharing the
  NumPy inputs' memory, with ``torch.set_num_threads`` set to Numba's thread count (only when
  torch is installed);
* ``numpy``: naive NumPy, one head at a time: the full ``L x S`` score matrix, softmax, then
  ``P V`` (float16 is computed in float32, since NumPy's float16 matmul has no BLAS). The floor.
"""

import math
import re
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..problem import flops
from .timing import rel_error, time_interleaved, torch_available

#: The implementations, in table order.
IMPLS = ("sdpa_numba", "torch", "numpy")
DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class Case:
    """One attention problem: ``(B, H, L, E)`` self-attention (``S = L``, ``Ev = E``)."""

    batch: int
    heads: int
    seq: int
    dim: int
    dtype: str = "float32"
    causal: bool = False

    @property
    def flops(self):
        """Forward FLOPs (:func:`sdpa_numba.problem.flops`): 4·B·H·L·S·E, half when causal."""
        return flops(self.batch, self.heads, self.seq, self.seq, self.dim, self.causal)

    @property
    def label(self):
        return (f"B{self.batch} H{self.heads} L{self.seq} D{self.dim} {self.dtype}"
                f"{' causal' if self.causal else ''}")


#: Named case lists. ``headline``: the three problems of the performance page's first table.
#: ``variants``: the attention variants against their peers (:func:`run_variants`; its own
#: table, not a case list).
PRESETS = {
    "headline": [Case(1, 8, 2048, 64, "float32", False), Case(1, 8, 2048, 64, "float32", True),
               Case(1, 4, 4096, 128, "float32", False)],
    "variants": [],
}

_CASE_RE = re.compile(r"^(\d+)x(\d+)x(\d+)x(\d+)((?::[a-z0-9]+)*)$")


def parse_case(spec):
    """``BxHxLxD[:dtype][:causal]``, e.g. ``1x8x2048x64:float32:causal``; ValueError if bad."""
    m = _CASE_RE.match(spec.strip().lower())
    if not m:
        raise ValueError(f"bad case {spec!r}: expected BxHxLxD[:dtype][:causal], e.g. "
                         f"1x8x2048x64:float32:causal")
    b, h, L, d = (int(x) for x in m.groups()[:4])
    if min(b, h, L, d) < 1:
        raise ValueError(f"bad case {spec!r}: sizes must be positive")
    dtype, causal = "float32", False
    for tag in filter(None, m.group(5).split(":")):
        if tag in DTYPES:
            dtype = tag
        elif tag == "causal":
            causal = True
        else:
            raise ValueError(f"bad case {spec!r}: unknown tag {tag!r} (a dtype among "
                             f"{', '.join(DTYPES)}, or 'causal')")
    return Case(b, h, L, d, dtype, causal)


def grid(batch, heads, seqs, dims, dtypes, causals):
    """Every combination, ordered so that a plot's lines run over ``seq``."""
    return [Case(batch, heads, L, d, dt, c)
            for dt in dtypes for d in dims for c in causals for L in seqs]


def numpy_dtype(name):
    """The NumPy dtype of a name of :data:`DTYPES` (bfloat16: ml_dtypes', TypeError without
    it)."""
    if name == "bfloat16":
        from .._bf16 import bfloat16

        return bfloat16()
    return np.dtype(name)


def make_inputs(case, seed=0):
    """Standard-normal ``q, k, v`` of shape ``(B, H, L, E)`` in the case's dtype."""
    rng = np.random.default_rng(seed)
    shape = (case.batch, case.heads, case.seq, case.dim)
    dtype = numpy_dtype(case.dtype)
    return tuple(rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(3))


def naive_numpy(q, k, v, is_causal=False):
    """Attention the obvious NumPy way, one head at a time (the whole score matrix)."""
    work = np.float32 if q.dtype.itemsize == 2 else q.dtype.type  # float16, bfloat16
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = np.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    L, S = q.shape[-2], k.shape[-2]
    above = np.triu(np.ones((L, S), dtype=bool), 1) if is_causal else None
    for idx in np.ndindex(q.shape[:-2]):
        s = (q[idx].astype(work, copy=False) @ k[idx].astype(work, copy=False).T) * work(scale)
        if above is not None:
            s[above] = -np.inf
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        out[idx] = s @ v[idx].astype(work, copy=False)
    return out


def prepare(impl, case, q, k, v):
    """A zero-argument callable that computes ``case`` with ``impl`` and returns a NumPy array."""
    if impl == "sdpa_numba":
        from .. import scaled_dot_product_attention as sdpa

        return lambda: sdpa(q, k, v, is_causal=case.causal)
    if impl == "torch":
        import torch

        bf16 = q.dtype.name == "bfloat16"  # torch.from_numpy has no bfloat16: same bits
        tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if bf16
                      else torch.from_numpy(x) for x in (q, k, v))
        f = torch.nn.functional.scaled_dot_product_attention

        def run():
            with torch.inference_mode():
                o = f(tq, tk, tv, is_causal=case.causal)
                return o.view(torch.int16).numpy().view(q.dtype) if bf16 else o.numpy()

        return run
    if impl == "numpy":
        return lambda: naive_numpy(q, k, v, case.causal)
    raise ValueError(f"unknown implementation {impl!r}: choose from {', '.join(IMPLS)}")


def sgemm_rates(n=4096, repeats=5):
    """GFLOP/s of an ``n x n`` float32 matmul: NumPy ``@`` and, if installed, ``torch.mm``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    fns = {"numpy": lambda: a @ b}
    if torch_available():
        import torch

        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        fns["torch"] = lambda: torch.mm(ta, tb)
    rates = {}
    for name, fn in fns.items():  # each in rounds of its own: two BLAS thread pools
        fn()
        rates[name] = 2.0 * n**3 / time_interleaved({name: fn}, repeats)[name] / 1e9
    return rates


def run_cases(cases, impls=IMPLS, repeats=5, progress=None, pause=None):
    """Time every case with every implementation; return a list of result dicts.

    ``progress``: an optional callable ``progress(n_steps_done, case_label)``, called once per
    warm-up call and once per timed round. The first sdpa_numba call for each dtype
    (compile or cache load) is reported as ``first_call_s`` and never mixed into the times.
    """
    impls = [i for i in impls if i != "torch" or torch_available()]
    seen = set()
    results = []
    for case in cases:
        q, k, v = make_inputs(case)
        fns = {impl: prepare(impl, case, q, k, v) for impl in impls}
        outs = {}
        first_call = None
        for impl, fn in fns.items():  # warm-up: compile, page in, fill caches
            t0 = time.perf_counter()
            outs[impl] = fn()
            if impl == "sdpa_numba" and case.dtype not in seen:
                seen.add(case.dtype)
                first_call = time.perf_counter() - t0
            if progress:
                progress(1, case.label)
        best = {name: math.inf for name in fns}
        peers = {n: f for n, f in fns.items() if n != "numpy"}
        floor = {n: f for n, f in fns.items() if n == "numpy"}
        for _ in range(repeats):
            for name, t in time_interleaved(peers, 1, pause).items():
                best[name] = min(best[name], t)
            if progress:
                progress(1, case.label)
        for name, t in time_interleaved(floor, repeats, pause).items():
            best[name] = t
        r = asdict(case)
        r["flops"] = case.flops
        r["time_s"] = best
        r["gflops"] = {name: case.flops / t / 1e9 for name, t in best.items()}
        if "sdpa_numba" in best and "torch" in best:
            r["speed_vs_torch"] = best["torch"] / best["sdpa_numba"]
            r["rel_err_vs_torch"] = rel_error(outs["sdpa_numba"], outs["torch"])
        if "sdpa_numba" in best and "numpy" in best:
            r["speed_vs_numpy"] = best["numpy"] / best["sdpa_numba"]
        if first_call is not None:
            r["first_call_s"] = first_call
        results.append(r)
    return results


def steps(cases, impls, repeats):
    """How many ``progress`` steps :func:`run_cases` will report."""
    n_impls = len([i for i in impls if i != "torch" or torch_available()])
    return len(cases) * (n_impls + repeats)
