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

import importlib.metadata
import math
import os
import platform
import re
import time
from dataclasses import asdict, dataclass

import numpy as np

from .problem import flops

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
        from ._bf16 import bfloat16

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


def torch_available():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def prepare(impl, case, q, k, v):
    """A zero-argument callable that computes ``case`` with ``impl`` and returns a NumPy array."""
    if impl == "sdpa_numba":
        from . import scaled_dot_product_attention as sdpa

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


#: Seconds of rest before each timed call. After a call, a library's worker threads spin for a
#: while before they sleep (OpenBLAS's for up to ~0.1 s by default); on a machine with few cores
#: they would steal the CPUs from the next implementation timed.
PAUSE = 0.2


def time_interleaved(fns, repeats, pause=None):
    """Minimum time of each callable over ``repeats`` interleaved rounds (warm them up first)."""
    pause = PAUSE if pause is None else pause
    best = {name: math.inf for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def rel_error(x, ref):
    """Relative Frobenius error ``||x - ref|| / ||ref||`` in float64."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), np.finfo(float).tiny))


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


def set_threads(n=None, torch_too=True):
    """Set Numba's thread count (``n``, or leave it) and torch's to the same; return it.

    ``torch_too=False`` leaves torch alone (and unimported).

    torch is imported *before* Numba starts its threads: torch imported after Numba's OpenMP
    threading layer has started ran its SDPA about 10x slower here (torch 2.13, numba 0.68,
    2 cores), which would flatter sdpa_numba in every comparison.
    """
    if torch_too and torch_available():
        import torch  # noqa: F401  (first: see above)
    import numba

    if n is not None:
        numba.set_num_threads(n)
    n = numba.get_num_threads()
    if torch_too and torch_available():
        import torch

        torch.set_num_threads(n)
    return n


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


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_cpu():
    """CPU name and the features LLVM (hence Numba) compiles for, honouring Numba's overrides.

    ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` replace the host's values when set.
    """
    import llvmlite.binding as llvm
    from numba.core import config

    name = config.CPU_NAME or llvm.get_host_cpu_name()
    if config.CPU_FEATURES is not None:
        enabled = [f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+")]
    else:
        enabled = [f for f, on in llvm.get_host_cpu_features().items() if on]
    return {"name": name, "features": sorted(enabled),
            "overridden": config.CPU_NAME is not None or config.CPU_FEATURES is not None}


def cuda_status():
    """``(usable, why)``: whether numba.cuda sees a GPU; never raises."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False, "NUMBA_ENABLE_CUDASIM=1: numba.cuda is the simulator (Python), no GPU"
    try:
        from numba import cuda
    except Exception as exc:  # numba-cuda absent or broken
        return False, f"numba.cuda cannot be imported ({type(exc).__name__}: {exc})"
    try:
        ok = bool(cuda.is_available())
    except Exception as exc:
        return False, f"numba.cuda.is_available() failed ({type(exc).__name__}: {exc})"
    if not ok:
        return False, "no CUDA GPU or driver found"
    try:
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        return True, f"{name}, compute capability {dev.compute_capability}"
    except Exception as exc:
        return True, f"available ({type(exc).__name__} while naming the device: {exc})"


def _parallel_probe(n):
    """A trivial parallel loop: running it makes Numba choose its threading layer."""
    import numba

    @numba.njit(parallel=True)
    def probe(n):
        total = 0
        for i in numba.prange(n):
            total += i
        return total

    return probe(n)


def threading_layer():
    """Numba's threading layer actually in use (runs a tiny parallel function to pick it)."""
    import numba

    try:
        return numba.threading_layer()
    except ValueError:  # nothing parallel has run yet
        pass
    _parallel_probe(4)
    return numba.threading_layer()


def load_average():
    """The 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def collect_info():
    """Versions, threads, CPU load, CPU features and CUDA availability, as a JSON-able dict.

    The 1-minute load average is there because timings on a machine that other processes keep
    busy are not worth much.
    """
    import numba

    from . import __version__

    cpu = host_cpu()
    feats = set(cpu["features"])
    usable, why = cuda_status()
    info = {
        "versions": {
            "sdpa_numba": __version__,
            "python": platform.python_version(),
            "numba": numba.__version__,
            "llvmlite": _version("llvmlite"),
            "numpy": np.__version__,
            "torch": _version("torch"),
            "numba-cuda": _version("numba-cuda"),
        },
        "threads": numba.get_num_threads(),
        "load_average_1min": load_average(),
        "threading_layer": threading_layer(),
        "platform": platform.platform(),
        "cpu": {"name": cpu["name"], "from_numba_env_override": cpu["overridden"],
                "avx2": "avx2" in feats, "fma": "fma" in feats, "avx512f": "avx512f" in feats,
                "avx512_extensions": sorted(f for f in feats if f.startswith("avx512")),
                "features": cpu["features"]},
        "cuda": {"usable": usable, "detail": why},
    }
    return info


# --- the variants preset ---------------------------------------------------------------------

#: The variants preset's problem (issue 15's speed targets): B1 H8 L2048 D64 float32, the soft
#: cap of Gemma 2 (30) and a causal sliding window of 256 keys.
VARIANTS_CASE = Case(1, 8, 2048, 64, "float32", False)
VARIANTS_SOFTCAP = 30.0
VARIANTS_WINDOW = 256


def visited_fraction(L, S, left, right, offset=0):
    """The fraction of the L x S scores the CPU forward computes under a window: per query
    sub-block of BM rows, the key blocks of BN keys from the first to the last key any of its
    rows sees (cut at that last key), as :func:`sdpa_numba.cpu.forward.attend_rows` visits
    them. ``None``: an unlimited side."""
    from .cpu.forward import BM, BN

    left = S + L if left is None else left
    right = S + L if right is None else right
    total = 0
    for i_first in range(0, L, BM):
        i_last = min(L, i_first + BM) - 1
        lo = max(i_first + offset - left, 0)
        hi = min(i_last + offset + right + 1, S)
        if hi > lo:
            total += (hi - lo // BN * BN) * (i_last - i_first + 1)
    return total / (L * S)


def _new_softcap_mod(c, vectorized=True):
    """A fresh ``@njit`` soft-cap score_mod (a new function: compiled from scratch), with
    :func:`sdpa_numba.cpu.tanh.tanh` (vectorizes) or ``math.tanh`` (a scalar libm call)."""
    import numba

    from .cpu.tanh import tanh

    if vectorized:
        @numba.njit
        def softcap_mod(score, b, h, i, j):
            return c * tanh(score / c)
    else:
        @numba.njit
        def softcap_mod(score, b, h, i, j):
            return c * math.tanh(score / c)

    return softcap_mod


def run_variants(repeats=5, pause=None, progress=None, case=VARIANTS_CASE,
                 softcap=VARIANTS_SOFTCAP, window=VARIANTS_WINDOW):
    """Time the variants against their peers on ``case``; a dict of rows and compile times.

    Rows (each the minimum of ``repeats`` interleaved rounds within its group, after warm-up):

    * soft cap: our dense forward, our built-in ``softcap``, our forward with a user's
      ``score_mod`` doing the same (with :func:`sdpa_numba.cpu.tanh.tanh`, and with
      ``math.tanh``), torch's SDPA (dense), and torch's ``flex_attention`` under
      ``torch.compile`` with the same score_mod;
    * sliding window ``window`` with causal: ours, flex_attention with a block mask of the
      same mask_mod, torch's SDPA given the equivalent bool mask; and the ideal time, the
      visited work (:func:`visited_fraction`) at our dense rate.

    Compile times: the first call with a new user score_mod (compiles the forward with it; a
    second new function in the same process; Numba does not cache kernels that take a
    function, so a new process pays it again), flex_attention's first calls (torch.compile).
    """
    import numba

    from . import scaled_dot_product_attention as sdpa

    q, k, v = make_inputs(case)
    B, H, L, E = case.batch, case.heads, case.seq, case.dim
    c = np.float32(softcap)
    times, compile_s = {}, {}
    fns = {
        "sdpa_numba dense": lambda: sdpa(q, k, v),
        "sdpa_numba softcap": lambda: sdpa(q, k, v, softcap=softcap),
    }
    t0 = time.perf_counter()
    mod = _new_softcap_mod(c)
    sdpa(q[:, :, :8], k[:, :, :8], v[:, :, :8], score_mod=mod)
    compile_s["score_mod, first call (compiles the forward with it)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mod_math = _new_softcap_mod(c, vectorized=False)
    sdpa(q[:, :, :8], k[:, :, :8], v[:, :, :8], score_mod=mod_math)
    compile_s["another new score_mod in the same process"] = time.perf_counter() - t0
    fns["sdpa_numba score_mod softcap"] = lambda: sdpa(q, k, v, score_mod=mod)
    fns["sdpa_numba score_mod softcap, math.tanh"] = lambda: sdpa(q, k, v, score_mod=mod_math)
    win = {"sdpa_numba window": lambda: sdpa(q, k, v, is_causal=True, window=(window, 0))}
    have_torch = torch_available()
    if have_torch:
        import torch
        import torch.nn.functional as F

        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        fns["torch SDPA dense"] = lambda: F.scaled_dot_product_attention(tq, tk, tv)
        ii = torch.arange(L)[:, None]
        jj = torch.arange(L)[None, :]
        band = (jj <= ii) & (ii - jj <= window)
        win["torch SDPA bool mask"] = lambda: F.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=band)
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention)

            def flex_softcap(score, b, h, q_idx, kv_idx):
                return softcap * torch.tanh(score / softcap)

            def sliding(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (q_idx - kv_idx <= window)

            block = create_block_mask(sliding, None, None, L, L, device="cpu")
            with torch.inference_mode():
                t0 = time.perf_counter()
                flex(tq, tk, tv, score_mod=flex_softcap)
                compile_s["flex_attention score_mod, first call (torch.compile)"] = \
                    time.perf_counter() - t0
                t0 = time.perf_counter()
                flex(tq, tk, tv, block_mask=block)
                compile_s["flex_attention block mask, first call (torch.compile)"] = \
                    time.perf_counter() - t0
            fns["torch flex_attention softcap"] = lambda: flex(tq, tk, tv,
                                                               score_mod=flex_softcap)
            win["torch flex_attention block mask"] = lambda: flex(tq, tk, tv, block_mask=block)
        except Exception as exc:  # noqa: BLE001 - flex_attention missing or not compiling
            compile_s[f"flex_attention unavailable: {type(exc).__name__}: {exc}"] = math.nan

    def timed(group):
        for fn in group.values():  # warm-up
            fn()
        if have_torch:
            import torch

            with torch.inference_mode():
                return time_interleaved(group, repeats, pause)
        return time_interleaved(group, repeats, pause)

    times.update(timed(fns))
    if progress:
        progress(1, "softcap")
    times.update(timed(win))
    if progress:
        progress(1, "window")
    visited = visited_fraction(L, L, window, 0)
    dense = times["sdpa_numba dense"]
    flops_dense = 4.0 * B * H * L * L * E
    rows = []
    for name, t in times.items():
        row = {"name": name, "time_s": t, "dense_gflops": flops_dense / t / 1e9}
        if "window" in name or "block mask" in name or "bool mask" in name:
            row["vs_ideal"] = t / (visited * dense)
        else:
            row["vs_dense"] = dense / t
        rows.append(row)
    ratios = {}
    for ours, peer in (("sdpa_numba softcap", "torch flex_attention softcap"),
                       ("sdpa_numba score_mod softcap", "torch flex_attention softcap"),
                       ("sdpa_numba dense", "torch SDPA dense"),
                       ("sdpa_numba window", "torch flex_attention block mask"),
                       ("sdpa_numba window", "torch SDPA bool mask")):
        if ours in times and peer in times:
            ratios[f"{ours} vs {peer}"] = times[peer] / times[ours]
    if "sdpa_numba score_mod softcap" in times:
        ratios["score_mod softcap / built-in softcap speed"] = (
            times["sdpa_numba softcap"] / times["sdpa_numba score_mod softcap"])
    return {"case": asdict(case), "softcap": softcap, "window": window,
            "threads": numba.get_num_threads(), "visited_fraction": visited,
            "ideal_window_s": visited * dense, "rows": rows, "ratios": ratios,
            "compile_s": compile_s}


def format_variants(res):
    """The variants preset's result as text."""
    lines = [f"variants: {VARIANTS_CASE.label}, softcap {res['softcap']}, window "
             f"({res['window']}, 0) causal; {res['threads']} threads; time = min of interleaved "
             f"rounds; GFLOP/s at the dense count 4*B*H*L*S*E"]
    lines.append(f"{'':40s} {'ms':>9s} {'GFLOP/s':>8s}  ratio")
    for r in res["rows"]:
        if "vs_dense" in r:
            extra = f"{r['vs_dense']:.2f} of our dense rate"
        else:
            extra = f"{r['vs_ideal']:.2f} x ideal (visited work at our dense rate)"
        lines.append(f"{r['name']:40s} {r['time_s'] * 1e3:9.2f} {r['dense_gflops']:8.1f}  "
                     f"{extra}")
    lines.append(f"window: visited fraction of the scores {res['visited_fraction']:.4f}, ideal "
                 f"{res['ideal_window_s'] * 1e3:.2f} ms")
    for k, v in res["ratios"].items():
        lines.append(f"{k}: {v:.2f}x")
    for k, v in res["compile_s"].items():
        lines.append(f"compile: {k}: {v:.2f} s" if v == v else f"compile: {k}")
    return "\n".join(lines)
