"""The 8-bit KV-cache formats' error against the original float cache (docs/serving.md).

    PYTHONPATH=. python scripts/quant_errors.py [--S 2048] [--seed 0]

For each format (int8 per token, q8_0, fp8 e4m3fn and e5m2 with one descale per tensor; and
float32 and float16 caches for comparison, the latter with float16 queries as it requires), the cache made by ``sdpa_numba.quantize_kv`` from a
float64 one is read by ``attention_with_kvcache``, and its output is compared with the float64
reference attention over the *original* cache (so the figure is the format's error plus the
kernel's, the kernel's alone being float32 rounding). Two key distributions: standard normal,
and keys with a few outlier channels (4 of 128 channels ten times larger and a per-token offset,
as the keys of trained LLMs have; one absmax scale then serves both small and large values).
Per case: the output's relative Frobenius error, the largest lse error, and top-1 agreement:
the share of (query, head) rows whose highest-scoring key (among those every query sees) is
the same with the stored keys as with the original ones (in float64, from the dequantized
cache).
"""

import argparse

import numpy as np

import sdpa_numba
from sdpa_numba.quant import dequantize_kv, quantize_kv
from sdpa_numba.reference import attention

FORMATS = ("int8", "q8_0", "e4m3fn", "e5m2")
B, HQ, H, E, LQ = 1, 8, 8, 128, 16


def keys(rng, S, kind):
    k = rng.standard_normal((B, S, H, E))
    if kind == "outliers":
        k[..., :4] *= 10.0
        k += rng.standard_normal((B, S, H, 1))
    return k


def stored(x, fmt):
    """The cache as ``attention_with_kvcache`` takes it: (cache, scale) and its float64
    meaning."""
    if fmt in ("float32", "float16"):
        c = x.astype(fmt)
        return c, None, c.astype(np.float64)
    values, scale = quantize_kv(x, fmt)
    return values, scale, dequantize_kv(values, scale, dtype=np.float64)


def case(rng, S, kind):
    q = rng.standard_normal((B, LQ, HQ, E))
    k, v = keys(rng, S, kind), rng.standard_normal((B, S, H, E))
    seqlens = np.array([S], np.int32)
    # (B, H, L, E) for the reference; the query's last LQ tokens end the cache (causal,
    # bottom-right as the kvcache call aligns them).
    t = (lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2)))
    ref_out, ref_lse = attention(t(q), t(k), t(v), is_causal=True, alignment="bottom_right")
    seen = S - LQ + 1  # the keys every query sees
    top = np.einsum("blhe,bshe->bhls", q, k[:, :seen]).argmax(-1)
    rows = []
    for fmt in ("float32", "float16", *FORMATS):
        kc, ks, kd = stored(k, fmt)
        vc, vs, _ = stored(v, fmt)
        out, lse = sdpa_numba.attention_with_kvcache(
            q.astype(fmt if fmt == "float16" else np.float32), kc, vc, seqlens, k_scale=ks, v_scale=vs, return_lse=True)
        o = np.swapaxes(out.astype(np.float64), 1, 2)
        rel = np.linalg.norm(o - ref_out) / np.linalg.norm(ref_out)
        lse_err = np.abs(lse.astype(np.float64) - ref_lse).max()
        agree = (np.einsum("blhe,bshe->bhls", q, kd[:, :seen]).argmax(-1) == top).mean()
        rows.append((fmt, rel, lse_err, agree))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, default=2048, help="cached tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"B{B} Hq{HQ} H{H} Lq{LQ} (causal) S{args.S} D{E}, float32 queries (float16 with the "
          f"float16 cache); error against "
          f"the float64 attention over the original cache\n")
    print("| keys | cache | output rel. error | max lse error | top-1 key agreement |")
    print("| --- | --- | ---: | ---: | ---: |")
    for kind in ("normal", "outliers"):
        for fmt, rel, lse_err, agree in case(rng, args.S, kind):
            print(f"| {kind} | {fmt} | {rel:.1e} | {lse_err:.1e} | {agree:.1%} |")


if __name__ == "__main__":
    main()
