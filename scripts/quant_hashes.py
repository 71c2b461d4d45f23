"""Bitwise hashes of the quantized KV-cache decode's results (``out`` and ``lse`` of
``attention_with_kvcache``), for a refactor of the kernel that must leave every one unchanged:
each format (int8 per token, q8_0, e4m3fn, e5m2), float32 / float16 / bfloat16 / float64
queries, MHA and GQA, one query token and several (chunked prefill), chunks split (keys beyond
one chunk of 512), paged caches (shuffled pages of 16), variants (ALiBi, soft cap, window),
float16 scales, head dims 128, 64 and 80 (not a multiple of the vector width: the scalar
loops), and the parallel kernel (a cache above the serial threshold).

    python scripts/quant_hashes.py --out new.json
    python scripts/quant_hashes.py --compare new.json    # exit 1 on any difference
"""

import argparse
import hashlib
import json
import sys

import numpy as np

FORMATS = ("int8", "q8_0", "e4m3fn", "e5m2")


def cases():
    """(name, kwargs of :func:`run_case`)."""
    out = []
    for fmt in FORMATS:
        for qdt in ("float32", "float16", "bfloat16", "float64"):
            out.append((f"{fmt}/{qdt}/mha", dict(fmt=fmt, qdt=qdt)))
        out.append((f"{fmt}/float32/gqa", dict(fmt=fmt, g=4)))
        out.append((f"{fmt}/float32/gqa-lq3", dict(fmt=fmt, g=4, lq=3)))
        out.append((f"{fmt}/float32/split", dict(fmt=fmt, s=1300, lens=(1300, 700))))
        out.append((f"{fmt}/float32/paged", dict(fmt=fmt, s=640, paged=16, lens=(600, 33))))
        out.append((f"{fmt}/bfloat16/gqa-paged",
                    dict(fmt=fmt, qdt="bfloat16", g=4, s=208, paged=16)))
        out.append((f"{fmt}/float32/alibi", dict(fmt=fmt, variants="alibi")))
        out.append((f"{fmt}/float32/softcap-window", dict(fmt=fmt, variants="softcap")))
        out.append((f"{fmt}/float32/d64", dict(fmt=fmt, d=64)))
        if fmt != "q8_0":
            out.append((f"{fmt}/float32/d80", dict(fmt=fmt, d=80)))
        if fmt in ("int8", "q8_0"):
            out.append((f"{fmt}/float32/f16-scales", dict(fmt=fmt, sdt="float16")))
        out.append((f"{fmt}/float32/parallel", dict(fmt=fmt, s=4096, h=32, lens=(4096,))))
    return out


def run_case(name, fmt, qdt="float32", g=1, lq=1, s=200, lens=(200, 77), paged=None,
             variants=None, d=128, sdt="float32", h=4):
    """``(out, lse)`` of one case (its data from a generator seeded by its name)."""
    import ml_dtypes

    from sdpa_numba import attention_with_kvcache, quantize_kv

    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:4],
                                               "little"))
    b = len(lens)
    dt = ml_dtypes.bfloat16 if qdt == "bfloat16" else np.dtype(qdt)
    q = rng.standard_normal((b, lq, h * g, d)).astype(dt)
    k = (rng.standard_normal((b, s, h, d)) * 2).astype(np.float32)
    v = rng.standard_normal((b, s, h, d)).astype(np.float32)
    kw = {} if fmt.startswith("e") else {"scale_dtype": np.dtype(sdt)}
    kq, ks = quantize_kv(k, fmt, **kw)
    vq, vs = quantize_kv(v, fmt, **kw)
    extra = {}
    if paged:
        # each sequence's keys on pages of `paged` slots, the pages shuffled
        n_pp = s // paged
        perm = rng.permutation(b * n_pp)
        table = perm.reshape(b, n_pp).astype(np.int32)

        def pages(x):
            if x.ndim == 0 or x.shape[:2] != (b, s):
                return x
            y = np.empty((b * n_pp, paged) + x.shape[2:], x.dtype)
            y[table.reshape(-1)] = x[:, :n_pp * paged].reshape((b * n_pp, paged) + x.shape[2:])
            return y
        kq, vq, ks, vs = pages(kq), pages(vq), pages(ks), pages(vs)
        extra["block_table"] = table
    if variants == "alibi":
        extra["alibi_slopes"] = np.linspace(0.05, 0.5, h * g).astype(np.float32)
    elif variants == "softcap":
        extra["softcap"] = 20.0
        extra["window"] = (150, 0)
    out, lse = attention_with_kvcache(q, kq, vq, np.array(lens, np.int64), k_scale=ks,
                                      v_scale=vs, return_lse=True, **extra)
    return np.asarray(out), np.asarray(lse)


def digest(a):
    a = np.ascontiguousarray(a)
    return hashlib.sha256(a.view(np.uint8).tobytes() + str(a.shape).encode()).hexdigest()[:16]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--compare")
    p.add_argument("--only", action="append", default=[])
    a = p.parse_args()
    got = {}
    for name, kw in cases():
        if a.only and not any(t in name for t in a.only):
            continue
        out, lse = run_case(name, **kw)
        got[name] = [digest(out), digest(lse)]
        print(name, *got[name], file=sys.stderr, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
    if a.compare:
        with open(a.compare) as f:
            ref = json.load(f)
        diff = [n for n in got if ref.get(n) != got[n]]
        missing = [n for n in got if n not in ref]
        print(f"{len(got)} cases, {len(diff)} differ{': ' + ', '.join(diff) if diff else ''}"
              f"{'; not in the reference: ' + ', '.join(missing) if missing else ''}")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
