"""The ``variants`` preset: the soft cap (built in and as a user's score_mod), and a causal
sliding window, against torch's ``flex_attention`` and SDPA (a table of its own)."""

import math
import time
from dataclasses import asdict, replace

import numpy as np

from .dense import Case, make_inputs
from .timing import time_interleaved, torch_available

#: The variants preset's problem (issue 15's speed targets): B1 H8 L2048 D64 float32, the soft
#: cap of Gemma 2 (30) and a causal sliding window of 256 keys.
VARIANTS_CASE = Case(1, 8, 2048, 64, "float32", False)
VARIANTS_SOFTCAP = 30.0
VARIANTS_WINDOW = 256
#: Chunked local attention (issue 31's target): Llama 4's causal chunks of 1024 positions at
#: L 8192, the rest as VARIANTS_CASE.
VARIANTS_CHUNK = 1024
CHUNK_SEQ = 8192


def _new_softcap_mod(c, vectorized=True):
    """A fresh ``@njit`` soft-cap score_mod (a new function: compiled from scratch), with
    :func:`sdpa_numba.mods.tanh` (vectorizes) or ``math.tanh`` (a scalar libm call)."""
    import numba

    from ..mods import tanh

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
                 softcap=VARIANTS_SOFTCAP, window=VARIANTS_WINDOW, chunk=VARIANTS_CHUNK,
                 chunk_seq=CHUNK_SEQ):
    """Time the variants against their peers on ``case``; a dict of rows and compile times.

    Rows (each the minimum of ``repeats`` interleaved rounds within its group, after warm-up):

    * soft cap: our dense forward, our built-in ``softcap``, our forward with a user's
      ``score_mod`` doing the same (with :func:`sdpa_numba.mods.tanh`, and with
      ``math.tanh``), torch's SDPA (dense), and torch's ``flex_attention`` under
      ``torch.compile`` with the same score_mod;
    * sliding window ``window`` with causal: ours, flex_attention with a block mask of the
      same mask_mod, torch's SDPA given the equivalent bool mask; and the ideal time, the
      visited work (:func:`sdpa_numba.tiles.visited_fraction`) at our dense rate;
    * causal chunks of ``chunk`` positions at sequence length ``chunk_seq`` (ours alone), and
      its ideal time: the visited work at our dense rate of the first group.

    Compile times: the first call with a new user score_mod (compiles the forward with it; a
    second new function in the same process; Numba does not cache kernels that take a
    function, so a new process pays it again), flex_attention's first calls (torch.compile).
    """
    import numba

    from .. import scaled_dot_product_attention as sdpa
    from ..tiles import visited_fraction

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
    qc, kc, vc = make_inputs(replace(case, seq=chunk_seq))
    chunked = {"sdpa_numba chunk": lambda: sdpa(qc, kc, vc, is_causal=True, chunk=chunk)}
    times.update(timed(chunked))
    if progress:
        progress(1, "chunk")
    visited = visited_fraction(L, L, window, 0)
    dense = times["sdpa_numba dense"]
    flops_dense = 4.0 * B * H * L * L * E
    # The ideal times: the visited work at our dense rate (a dense call at chunk_seq would do
    # (chunk_seq / L)^2 times the dense call's work).
    visited_chunk = visited_fraction(chunk_seq, chunk_seq, None, 0, chunk=chunk)
    ideal = {name: visited * dense for name in win}
    ideal["sdpa_numba chunk"] = visited_chunk * dense * (chunk_seq / L) ** 2
    rows = []
    for name, t in times.items():
        scale = (chunk_seq / L) ** 2 if name in chunked else 1.0
        row = {"name": name, "time_s": t, "dense_gflops": scale * flops_dense / t / 1e9}
        if name in ideal:
            row["vs_ideal"] = t / ideal[name]
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
            "ideal_window_s": visited * dense, "chunk": chunk, "chunk_seq": chunk_seq,
            "chunk_visited_fraction": visited_chunk,
            "ideal_chunk_s": ideal["sdpa_numba chunk"], "rows": rows, "ratios": ratios,
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
    if "chunk" in res:
        lines.append(f"chunk: causal chunks of {res['chunk']} at L {res['chunk_seq']} (GFLOP/s "
                     f"at that L's dense count), visited fraction of the scores "
                     f"{res['chunk_visited_fraction']:.4f}, ideal "
                     f"{res['ideal_chunk_s'] * 1e3:.2f} ms")
    for k, v in res["ratios"].items():
        lines.append(f"{k}: {v:.2f}x")
    for k, v in res["compile_s"].items():
        lines.append(f"compile: {k}: {v:.2f} s" if v == v else f"compile: {k}")
    return "\n".join(lines)
