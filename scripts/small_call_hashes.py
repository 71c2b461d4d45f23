#!/usr/bin/env python
"""Bitwise hashes of ~20 small calls (issue 33's small-call fast paths must not move a bit).

Forward (float32, float64, float16; one row against 512 keys and a parallel H8 L256; GQA,
2-D, a broadcast batch, a bool mask, a window, a soft cap, scales), backward (with and
without broadcast), varlen forward and backward, merge (two parts, n parts); each call made
twice (the second finds the cached plan). Run it from the root of each checkout:

    cd old-checkout && python /path/to/small_call_hashes.py --out before.json
    python scripts/small_call_hashes.py --compare before.json   # exit 1 if any differs
"""

import argparse
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.getcwd())  # the checkout judged: the current directory's package


def h(*arrays):
    d = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        d.update(f"{a.dtype.str}{a.shape}".encode())
        d.update(a.tobytes())
    return d.hexdigest()[:16]


def main():
    import sdpa_numba as sn

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--compare")
    args = ap.parse_args()
    rng = np.random.default_rng(33)

    def r(*s, dt=np.float32):
        return rng.standard_normal(s).astype(dt)

    fwd = sn.scaled_dot_product_attention
    bwd = sn.scaled_dot_product_attention_backward
    cases = {}
    q, k, v = r(1, 1, 1, 64), r(1, 1, 512, 64), r(1, 1, 512, 64)
    cases["fwd/f32/row512"] = lambda: fwd(q, k, v, return_lse=True)
    cases["fwd/f32/row512-causal-scale"] = lambda: fwd(q, k, v, is_causal=True, scale=0.3,
                                                       return_lse=True)
    q3, k3, v3 = r(2, 37, 7, dt=np.float64), r(2, 50, 7, dt=np.float64), r(2, 50, 5, dt=np.float64)
    cases["fwd/f64/3d-causal"] = lambda: fwd(q3, k3, v3, is_causal=True, return_lse=True)
    qg, kg, vg = r(1, 4, 13, 9), r(1, 2, 11, 9), r(1, 2, 11, 6)
    cases["fwd/f32/gqa"] = lambda: fwd(qg, kg, vg, enable_gqa=True, return_lse=True)
    q2, k2, v2 = r(13, 7), r(11, 7), r(11, 5)
    cases["fwd/f32/2d"] = lambda: fwd(q2, k2, v2, return_lse=True)
    qb, kb, vb = r(2, 1, 3, 5), r(1, 1, 17, 5), r(1, 1, 17, 3)
    cases["fwd/f32/bcast"] = lambda: fwd(qb, kb, vb, return_lse=True)
    m = rng.random((13, 11)) > 0.3
    q2d, k2d, v2d = (x.astype(np.float64) for x in (q2, k2, v2))
    cases["fwd/f64/bool-mask"] = lambda: fwd(q2d, k2d, v2d, m, return_lse=True)
    cases["fwd/f32/window"] = lambda: fwd(q3.astype(np.float32), k3.astype(np.float32),
                                          v3.astype(np.float32), window=(3, 0),
                                          return_lse=True)
    cases["fwd/f32/softcap"] = lambda: fwd(qg, kg, vg, enable_gqa=True, softcap=2.5,
                                           return_lse=True)
    ql, kl, vl = r(1, 8, 256, 64), r(1, 8, 256, 64), r(1, 8, 256, 64)
    cases["fwd/f32/parallel-H8-L256"] = lambda: fwd(ql, kl, vl, is_causal=True, return_lse=True)
    qh, kh, vh = (x.astype(np.float16) for x in (q, k, v))
    cases["fwd/f16/row512"] = lambda: fwd(qh, kh, vh, return_lse=True)

    def backward(q, k, v, **kw):
        o, l = fwd(q, k, v, return_lse=True, **kw)
        g = np.random.default_rng(1).standard_normal(o.shape).astype(o.dtype)
        return bwd(g, q, k, v, o, l, **kw)
    cases["bwd/f32/row512"] = lambda: backward(q, k, v)
    cases["bwd/f64/3d-causal"] = lambda: backward(q3, k3, v3, is_causal=True)
    cases["bwd/f32/gqa"] = lambda: backward(qg, kg, vg, enable_gqa=True)
    cases["bwd/f32/bcast"] = lambda: backward(qb, kb, vb)

    cu1q, cu1k = np.array([0, 1], np.int32), np.array([0, 512], np.int32)
    vq, vk, vv = r(1, 1, 64), r(512, 1, 64), r(512, 1, 64)
    cases["varlen/f32/row512"] = lambda: sn.varlen_attention(vq, vk, vv, cu1q, cu1k,
                                                             return_lse=True)
    cu = np.array([0, 5, 9, 30], np.int32)
    sq, sk, sv = r(30, 2, 8), r(30, 2, 8), r(30, 2, 8)

    def varlen_bwd():
        o, l = sn.varlen_attention(sq, sk, sv, cu, cu, is_causal=True, return_lse=True)
        g = np.random.default_rng(2).standard_normal(o.shape).astype(o.dtype)
        return (o, l) + tuple(sn.varlen_attention_backward(g, sq, sk, sv, o, l, cu, cu,
                                                           is_causal=True))
    cases["varlen/f32/causal-fwd-bwd"] = varlen_bwd
    oa, la = fwd(q, k, v, return_lse=True)
    ob, lb = fwd(q, r(1, 1, 512, 64), r(1, 1, 512, 64), return_lse=True)
    cases["merge/f32/two"] = lambda: sn.merge_attention_states(oa, la, ob, lb)
    outs, lses = r(3, 2, 5, 7, dt=np.float64), r(3, 2, 5, dt=np.float64)
    cases["merge/f64/nary"] = lambda: sn.merge_attention_states(outs, lses)

    hashes = {}
    for name, fn in cases.items():
        first = h(*fn())
        again = h(*fn())
        hashes[name] = first if first == again else f"{first} (second call {again})"
        print(f"{name:32s} {hashes[name]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(hashes, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        differ = [n for n in hashes if before.get(n) != hashes[n]]
        print(f"compare: {len(hashes) - len(differ)} same, {len(differ)} differ: {differ}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
