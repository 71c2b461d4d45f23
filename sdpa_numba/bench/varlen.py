"""The varlen benchmark, for ``python -m sdpa_numba bench --preset varlen``.

A ragged prefill batch (issue 16's target): 8 sequences of 100 to 2000 tokens (lengths drawn
with a fixed seed), causal, H8 D64 float32, packed back to back for
:func:`~sdpa_numba.varlen_attention`. torch's SDPA has no packed form; it is timed both ways a
user would run it, on inputs already laid out for it (the layout work is not timed):

* padded: the batch padded to the longest sequence, ``(B, H, L_max, D)``, with a bool mask
  (causal and the key within the sequence);
* loop: one ``scaled_dot_product_attention(..., is_causal=True)`` call per sequence.

The backward likewise: ``varlen_attention_backward`` against torch's autograd backward of
each way (``torch.autograd.backward`` of the outputs kept from one forward). Times are the
minimum of interleaved rounds with a pause before each call
(:func:`sdpa_numba.bench.timing.time_interleaved`); the ratio is the faster torch way's time over ours.
"""

import numpy as np

from .timing import rel_error, time_interleaved, torch_available

#: Sequences, heads, head dim, dtype of the preset; lengths 100..2000 from a fixed seed.
N_SEQ, HEADS, DIM, DTYPE = 8, 8, 64, "float32"
PRESETS = {"varlen": None}


def lengths(n=N_SEQ, lo=100, hi=2000, seed=16):
    """The sequence lengths: ``lo`` and ``hi`` and ``n - 2`` drawn between them (fixed seed),
    in a shuffled order."""
    rng = np.random.default_rng(seed)
    ls = np.concatenate([[lo, hi], rng.integers(lo, hi + 1, n - 2)])
    return rng.permutation(ls).astype(np.int64)


def prepare(lens, heads, dim, dtype, seed=0):
    """``(forward, backward)``: dicts of ``{impl: zero-argument callable}``; the forwards
    return the output packed ``(total, H, D)``, the backwards dq packed."""
    from .. import varlen_attention, varlen_attention_backward

    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(cu[-1])
    q, k, v, g = (rng.standard_normal((total, heads, dim)).astype(dt) for _ in range(4))
    out, lse = varlen_attention(q, k, v, cu, cu, is_causal=True, return_lse=True)
    fwd = {"sdpa_numba": lambda: varlen_attention(q, k, v, cu, cu, is_causal=True)}
    bwd = {"sdpa_numba": lambda: varlen_attention_backward(g, q, k, v, out, lse, cu, cu,
                                                           is_causal=True)[0]}
    if not torch_available():
        return fwd, bwd
    import torch

    f = torch.nn.functional.scaled_dot_product_attention
    n, lmax = len(lens), int(max(lens))

    def padded(x):
        p = np.zeros((n, heads, lmax, dim), dt)
        for b in range(n):
            p[b, :, :lens[b]] = x[cu[b]:cu[b + 1]].transpose(1, 0, 2)
        return torch.from_numpy(p)

    def unpad(t):
        t = t.detach().numpy()
        return np.concatenate([t[b, :, :lens[b]].transpose(1, 0, 2) for b in range(n)])

    def per_seq(x):  # (1, H, L_b, D): 4-D, as torch's fused CPU kernels want
        return [torch.from_numpy(np.ascontiguousarray(x[cu[b]:cu[b + 1]].transpose(1, 0, 2)))[
            None] for b in range(n)]

    ar = np.arange(lmax)
    keep = (ar[None, :] <= ar[:, None])[None] & (ar[None, None, :] < np.asarray(lens)[:, None,
                                                                                      None])
    mask = torch.from_numpy(keep[:, None])  # (B, 1, L_max, L_max)
    pq, pk, pv, pg = (padded(x) for x in (q, k, v, g))
    sq, sk, sv, sg = (per_seq(x) for x in (q, k, v, g))

    def torch_padded():
        with torch.inference_mode():
            return unpad(f(pq, pk, pv, attn_mask=mask))

    def torch_loop():
        with torch.inference_mode():
            outs = [f(a, b, c, is_causal=True) for a, b, c in zip(sq, sk, sv)]
        return np.concatenate([o[0].numpy().transpose(1, 0, 2) for o in outs])

    fwd["torch padded"] = torch_padded
    fwd["torch loop"] = torch_loop

    # the backwards: one forward each, kept; the timed call is the backward alone
    gq = pq.clone().requires_grad_()
    gk, gv = pk.clone().requires_grad_(), pv.clone().requires_grad_()
    pout = f(gq, gk, gv, attn_mask=mask)
    lq = [x.clone().requires_grad_() for x in sq]
    lk = [x.clone().requires_grad_() for x in sk]
    lv = [x.clone().requires_grad_() for x in sv]
    louts = [f(a, b, c, is_causal=True) for a, b, c in zip(lq, lk, lv)]

    def torch_padded_backward():
        gq.grad = gk.grad = gv.grad = None
        torch.autograd.backward(pout, pg, retain_graph=True)
        return unpad(gq.grad)

    def torch_loop_backward():
        for x in (*lq, *lk, *lv):
            x.grad = None
        torch.autograd.backward(louts, sg, retain_graph=True)
        return np.concatenate([x.grad[0].numpy().transpose(1, 0, 2) for x in lq])

    bwd["torch padded"] = torch_padded_backward
    bwd["torch loop"] = torch_loop_backward
    return fwd, bwd


def run(repeats=7, pause=None):
    """Time the preset; returns a dict with the lengths and, per direction, the times, the
    ratio to the faster torch way and the error against it."""
    lens = lengths()
    fwd, bwd = prepare(lens, HEADS, DIM, DTYPE)
    res = {"lengths": [int(x) for x in lens], "heads": HEADS, "dim": DIM, "dtype": DTYPE,
           "causal": True, "timing": f"min of {repeats} interleaved rounds"}
    for name, fns in (("forward", fwd), ("backward", bwd)):
        outs = {n: np.asarray(fn(), np.float64) for n, fn in fns.items()}  # warm-up
        best = time_interleaved(fns, repeats, pause)
        r = {"time_s": best}
        torch_ways = {n: t for n, t in best.items() if n.startswith("torch")}
        if torch_ways:
            fastest = min(torch_ways, key=torch_ways.get)
            r["fastest_torch"] = fastest
            r["speed_vs_torch"] = torch_ways[fastest] / best["sdpa_numba"]
            r["rel_err_vs_torch"] = rel_error(outs["sdpa_numba"], outs["torch loop"])
        res[name] = r
    return res


def format_result(res):
    """The preset's result as text."""
    lines = [f"varlen: {len(res['lengths'])} sequences, lengths {res['lengths']}, causal, "
             f"H{res['heads']} D{res['dim']} {res['dtype']} ({res['timing']})"]
    for name in ("forward", "backward"):
        r = res[name]
        times = ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in r["time_s"].items())
        line = f"  {name}: {times}"
        if "speed_vs_torch" in r:
            line += (f"; vs the faster torch way ({r['fastest_torch']}): "
                     f"{r['speed_vs_torch']:.2f}x; error vs torch {r['rel_err_vs_torch']:.1e}")
        lines.append(line)
    return "\n".join(lines)
