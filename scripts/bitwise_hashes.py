"""Bitwise hashes of the library's results: a refactor must leave every one of them unchanged.

Runs the public API only (the top-level names of :mod:`sdpa_numba` and
:mod:`sdpa_numba.distributed`), so that the same script judges the code before and after a
restructuring. Each case computes outputs, log-sum-exps and gradients on fixed random inputs
of odd sizes and hashes their bytes (with dtype and shape) with SHA-256:

* the dense forward and backward (float64, float32, float16, bfloat16; GQA; bool and float
  masks, the mask's gradient; causal; dropout with a seed; 2-D inputs; a batch broadcast);
* every variant (window, bottom-right alignment, soft cap, ALiBi slopes, sinks, ``score_mod``
  with ``score_mod_grad``, ``mask_mod``, a block mask from ``create_block_mask``) forward and
  backward;
* ``varlen_attention`` and ``varlen_attention_backward``;
* ``attention_with_kvcache``: contiguous and paged caches (page sizes 1 and 16, shuffled
  pages), appends of new keys and values (the caches after the call are hashed too), left
  padding, GQA, long sequences split into several chunks (split-KV), variants;
* ``merge_attention_states`` (two parts, n parts);
* ``sdpa_numba.distributed.ring_attention`` forward and backward at 2 ranks
  (``mpiexec -n 2`` next to the interpreter);

on the CPU kernels, and a smaller set of tiny cases on the CUDA kernels under Numba's CUDA
simulator (a subprocess with ``NUMBA_ENABLE_CUDASIM=1``; the ring too).

    python scripts/bitwise_hashes.py --out before.json        # hash and save
    python scripts/bitwise_hashes.py --compare before.json    # exit 1 if any case differs
    python scripts/bitwise_hashes.py --cpu-only --no-ring     # the in-process cases only

It imports ``sdpa_numba`` from the current directory (run it from the root of the checkout to
judge, e.g. ``cd old-checkout && python /path/to/bitwise_hashes.py --out old.json``), and its
subprocesses too.

One line per case: ``name  sha256[:16]``, then the combined hash (SHA-256 over the sorted
``name=hash`` lines). The library promises bitwise results for any thread count, so the hashes
must not depend on ``NUMBA_NUM_THREADS``.
"""

import argparse
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np
from numba import njit

#: The checkout judged: the current directory (``python scripts/x.py`` puts scripts/ first on
#: the path, which would import the installed package instead).
ROOT = pathlib.Path.cwd()
sys.path.insert(0, str(ROOT))
SEED = 1234  # dropout seed


# --------------------------------------------------------------------------------------------
# user functions of the variants (module level: Numba compiles them into the kernels)

# One score_mod and one mask_mod, sharing their mod_args, for every case that takes them: a
# kernel specialized on a user's function is compiled in every process (Numba cannot cache
# it), so few of them keep a warm run short.

@njit
def tanh_bias_mod(s, b, h, i, j, table, doc_q, doc_k):
    return 2.0 * np.tanh(s / 2.0) + table[h, abs(i - j)]


@njit
def tanh_bias_mod_grad(s, b, h, i, j, table, doc_q, doc_k):
    t = np.tanh(s / 2.0)
    return 1.0 - t * t


@njit
def doc_stripes_mask(b, h, i, j, table, doc_q, doc_k):
    return doc_q[i] == doc_k[j] and (i + j + h + b) % 5 != 0


# --------------------------------------------------------------------------------------------
# hashing

def digest(arrays):
    """SHA-256 of the arrays' dtypes, shapes and bytes (C order), in order; None entries are
    hashed as such."""
    h = hashlib.sha256()
    for a in arrays:
        if a is None:
            h.update(b"None;")
            continue
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype.name}{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def combined(hashes):
    return hashlib.sha256("".join(f"{k}={v}\n" for k, v in sorted(hashes.items()))
                          .encode()).hexdigest()


def rng_for(name):
    return np.random.default_rng(zlib.crc32(name.encode()))


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------------------------
# the cases: each takes the target (to_dev, to_host) and returns the arrays to hash

class Target:
    """Where a case runs: ``dev`` makes the target's array of a host array, ``host`` the
    reverse (both the identity on the CPU)."""

    def __init__(self, name):
        self.name = name
        if name == "cuda":
            from numba import cuda

            self.dev = lambda x: None if x is None else cuda.to_device(np.ascontiguousarray(x))
            self.host = lambda x: (x.copy_to_host() if hasattr(x, "copy_to_host")
                                   else None if x is None else np.asarray(x))
        else:
            self.dev = lambda x: x
            self.host = lambda x: None if x is None else np.asarray(x)


def dense(t, name, dtype, qs, ks, vs, mask=None, backward=True, mask_grad=False, **kw):
    """Forward (out, lse) and, with ``backward``, the gradients of one dense call."""
    import sdpa_numba

    rng = rng_for(name)
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, vs, dtype)
    variants = {}
    for key, val in kw.items():  # arrays the case asks for by shape
        if key in ("alibi_slopes", "sinks") and isinstance(val, tuple):
            val = rng.uniform(0.1, 0.9, val) if key == "alibi_slopes" else rng.standard_normal(val)
            if key == "sinks":
                val[0] = -np.inf
        variants[key] = val
    if isinstance(mask, tuple):  # (shape, kind)
        shape, kind = mask
        mask = (rng.random(shape) > 0.3 if kind == "bool"
                else rng.standard_normal(shape).astype(dtype))
    dq, dk, dv, dm = (t.dev(x) for x in (q, k, v, mask))
    out, lse = sdpa_numba.scaled_dot_product_attention(dq, dk, dv, dm, return_lse=True,
                                                       **variants)
    res = [t.host(out), t.host(lse)]
    if backward:
        g = randn(rng, res[0].shape, dtype)
        grads = sdpa_numba.scaled_dot_product_attention_backward(
            t.dev(g), dq, dk, dv, out, lse, dm, mask_grad=mask_grad, **variants)
        res += [t.host(x) for x in grads]
    return res


def bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


Q4, K4 = (2, 3, 13, 7), (2, 3, 11, 7)
V4 = (2, 3, 11, 5)


def dense_cases():
    """(name, targets, fn(target)) of the dense forward and backward; CUDA sizes are tiny."""
    def tiny(qs, ks, vs):
        # The simulator runs every GPU thread in Python: L 5, S 7, E 5 and one batch entry
        # (unless the case broadcasts k and v over the batch).
        if len(qs) == 4 and qs[0] == ks[0]:
            qs, ks, vs = (1,) + qs[1:], (1,) + ks[1:], (1,) + vs[1:]
        return (qs[:-2] + (5, qs[-1] - 2), ks[:-2] + (7, ks[-1] - 2), vs[:-2] + (7, vs[-1]))

    specs = [
        # name, dtype, q, k, v, mask, kwargs
        ("f64", np.float64, Q4, K4, V4, None, {}),
        ("f32", np.float32, Q4, K4, V4, None, {}),
        ("f16", np.float16, Q4, K4, V4, None, {}),
        ("bf16", "bf16", Q4, K4, V4, None, {}),
        ("f32-causal-gqa", np.float32, (2, 4, 13, 7), (2, 2, 11, 7), (2, 2, 11, 5), None,
         {"is_causal": True, "enable_gqa": True}),
        ("f64-bool-mask-causal-bcast", np.float64, (2, 3, 13, 7), (1, 3, 11, 7),
         (1, 3, 11, 5), ((3, 13, 11), "bool"), {"is_causal": True, "scale": 0.37}),
        ("f32-float-mask-grad", np.float32, Q4, K4, V4, ((1, 3, 1, 11), "float"),
         {"mask_grad": True}),
        ("f16-float-mask-causal", np.float16, Q4, K4, V4, ((13, 11), "float"),
         {"is_causal": True}),
        ("f32-dropout", np.float32, Q4, K4, V4, None, {"dropout_p": 0.3, "seed": SEED}),
        ("f64-dropout-causal-gqa", np.float64, (1, 4, 13, 7), (1, 2, 11, 7), (1, 2, 11, 5),
         None, {"dropout_p": 0.25, "seed": SEED, "is_causal": True, "enable_gqa": True}),
        ("f64-2d", np.float64, (13, 7), (11, 7), (11, 5), None, {"is_causal": True}),
        # the variants
        ("f32-window", np.float32, Q4, K4, V4, None, {"window": (3, 2)}),
        ("f64-window-left-causal", np.float64, Q4, K4, V4, None,
         {"window": (4, None), "is_causal": True}),
        ("f32-bottom-right-causal", np.float32, (2, 3, 9, 7), K4, V4, None,
         {"alignment": "bottom_right", "is_causal": True}),
        ("f32-softcap", np.float32, Q4, K4, V4, None, {"softcap": 2.5}),
        ("f32-alibi", np.float32, Q4, K4, V4, None, {"alibi_slopes": (3,)}),
        ("f64-alibi-batch", np.float64, Q4, K4, V4, None, {"alibi_slopes": (2, 3),
                                                           "is_causal": True}),
        ("f32-sinks", np.float32, Q4, K4, V4, None, {"sinks": (3,)}),
        ("f32-score-mod-mask-mod", np.float32, Q4, K4, V4, None, "mods"),
        ("f64-score-mod-mask-mod-block-mask", np.float64, (1, 3, 13, 7), (1, 3, 11, 7),
         (1, 3, 11, 5), None, "block_mask"),
        ("f64-all-variants", np.float64, (2, 4, 9, 7), (2, 2, 11, 7), (2, 2, 11, 5), None,
         {"window": (5, 1), "alignment": "bottom_right", "is_causal": True, "softcap": 3.0,
          "alibi_slopes": (4,), "sinks": (4,), "enable_gqa": True}),
    ]
    cuda_ok = {"f64", "f32", "f16", "f32-causal-gqa", "f64-bool-mask-causal-bcast",
               "f32-float-mask-grad", "f32-dropout", "f32-window", "f32-bottom-right-causal",
               "f32-softcap", "f32-alibi", "f32-sinks", "f32-score-mod-mask-mod",
               "f64-score-mod-mask-mod-block-mask", "f64-all-variants"}
    cases = []
    for name, dtype, qs, ks, vs, mask, kw in specs:
        def fn(t, name=name, dtype=dtype, qs=qs, ks=ks, vs=vs, mask=mask, kw=kw):
            if t.name == "cuda":
                qs, ks, vs = tiny(qs, ks, vs)
                if mask is not None:
                    mshape = tuple(min(n, m) for n, m in zip(mask[0][::-1], (7, 5)))[::-1]
                    mask = (mask[0][:-2] + mshape, mask[1])
            dt = bf16() if dtype == "bf16" else dtype
            kw = dict(kw) if isinstance(kw, dict) else mod_kwargs(kw, t, name, qs, ks)
            mask_grad = kw.pop("mask_grad", False)
            return dense(t, name, dt, qs, ks, vs, mask, mask_grad=mask_grad, **kw)
        cases.append((f"dense/{name}", ("cpu", "cuda") if name in cuda_ok else ("cpu",), fn))
    return cases


def mod_args(t, name, H, L, S):
    """The mod_args of :func:`tanh_bias_mod` and :func:`doc_stripes_mask`: a bias table per
    head and distance, and each query's and key's document (sorted ids)."""
    rng = rng_for(name + "/mod")
    table = rng.standard_normal((H, max(L, S)))
    doc_q = np.sort(rng.integers(0, 3, L)).astype(np.int64)
    doc_k = np.sort(rng.integers(0, 3, S)).astype(np.int64)
    doc_k[0] = doc_q[0]  # every row sees some key
    return (t.dev(table), t.dev(doc_q), t.dev(doc_k)), (table, doc_q, doc_k)


def mod_kwargs(kind, t, name, qs, ks):
    """The keywords of the score_mod / mask_mod / block_mask cases."""
    import sdpa_numba

    args, host_args = mod_args(t, name, qs[-3], qs[-2], ks[-2])
    kw = {"score_mod": tanh_bias_mod, "score_mod_grad": tanh_bias_mod_grad,
          "mask_mod": doc_stripes_mask, "mod_args": args, "is_causal": kind == "mods"}
    if kind == "block_mask":
        kw["block_mask"] = sdpa_numba.create_block_mask(
            doc_stripes_mask, math.prod(qs[:-3]), qs[-3], qs[-2], ks[-2], host_args)
    return kw


def varlen_cases():
    import sdpa_numba

    specs = [
        # name, dtype, Hq, H, E, Ev, cu_q, cu_k, kwargs
        ("f32-causal-gqa", np.float32, 4, 2, 7, 5, [0, 3, 3, 10, 17], [0, 5, 6, 6, 15],
         {"is_causal": True, "alignment": "bottom_right"}),
        ("f64-window-dropout", np.float64, 3, 3, 5, 6, [0, 7, 8, 19], [0, 4, 13, 22],
         {"window": (3, 1), "dropout_p": 0.2, "seed": SEED}),
        ("f64-softcap-alibi-sinks", np.float64, 2, 1, 6, 5, [0, 5, 11], [0, 9, 11],
         {"softcap": 2.0, "alibi_slopes": (2,), "sinks": (2,), "is_causal": True}),
        ("f16", np.float16, 2, 2, 7, 5, [0, 9, 11, 14], [0, 4, 11, 20], {}),
    ]
    cases = []
    for name, dtype, hq, h, e, ev, cu_q, cu_k, kw in specs:
        def fn(t, name=name, dtype=dtype, hq=hq, h=h, e=e, ev=ev, cu_q=cu_q, cu_k=cu_k, kw=kw):
            rng = rng_for("varlen/" + name)
            cu_q, cu_k = np.array(cu_q, np.int32), np.array(cu_k, np.int64)
            q = randn(rng, (cu_q[-1], hq, e), dtype)
            k = randn(rng, (cu_k[-1], h, e), dtype)
            v = randn(rng, (cu_k[-1], h, ev), dtype)
            kw = dict(kw)
            if "alibi_slopes" in kw:
                kw["alibi_slopes"] = rng.uniform(0.1, 0.9, kw["alibi_slopes"])
            if "sinks" in kw:
                kw["sinks"] = rng.standard_normal(kw["sinks"])
            dq, dk, dv = t.dev(q), t.dev(k), t.dev(v)
            out, lse = sdpa_numba.varlen_attention(dq, dk, dv, cu_q, cu_k, return_lse=True, **kw)
            g = randn(rng, t.host(out).shape, dtype)
            grads = sdpa_numba.varlen_attention_backward(t.dev(g), dq, dk, dv, out, lse, cu_q,
                                                         cu_k, **kw)
            return [t.host(out), t.host(lse), *(t.host(x) for x in grads)]
        cases.append((f"varlen/{name}", ("cpu", "cuda") if name != "f16" else ("cpu",), fn))
    return cases


def shuffled_pages(rng, caches, page_size):
    """The contiguous caches ``(B, S, H, E)`` as paged ones of shuffled pages (with spare
    pages of noise), and their block table."""
    B, S = caches[0].shape[:2]
    max_pages = -(-S // page_size)
    n = B * max_pages + 3
    table = rng.permutation(n)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    paged = []
    for c in caches:
        p = rng.standard_normal((n, page_size) + c.shape[2:]).astype(c.dtype)
        for b in range(B):
            for j in range(max_pages):
                rows = c[b, j * page_size:(j + 1) * page_size]
                p[table[b, j], :len(rows)] = rows
        paged.append(p)
    return (*paged, table)


def kvcache_cases():
    import sdpa_numba

    specs = [
        # name, dtype, B, Lq, Hq, H, E, Ev, S_max, seqlens, new tokens, leftpad, page, kwargs
        ("contig-f32-gqa-append-leftpad", np.float32, 3, 2, 4, 2, 7, 5, 21, [4, 0, 9], 2,
         [1, 0, 3], None, {}),
        ("contig-f64-decode", np.float64, 2, 1, 3, 3, 5, 6, 17, [15, 6], 0, None, None,
         {"is_causal": False}),
        ("paged1-f32-append", np.float32, 2, 3, 2, 1, 7, 5, 19, [7, 11], 3, None, 1, {}),
        ("paged16-f64-gqa-append-leftpad", np.float64, 3, 2, 4, 2, 5, 7, 48, [20, 1, 33], 2,
         [2, 0, 5], 16, {}),
        ("contig-f32-split-kv", np.float32, 2, 2, 2, 1, 7, 5, 1301, [1299, 600], 0, None,
         None, {}),
        ("paged16-f32-split-kv-append", np.float32, 2, 1, 2, 2, 7, 5, 1120, [1100, 530], 1,
         None, 16, {}),
        ("contig-f64-variants", np.float64, 2, 3, 4, 2, 5, 5, 25, [12, 20], 1, [0, 2], None,
         {"window": (6, 0), "softcap": 3.0, "alibi_slopes": (2, 4), "sinks": (4,)}),
        ("paged1-f32-mods", np.float32, 2, 2, 2, 2, 7, 5, 13, [5, 9], 1, None, 1,
         {"mods": True}),
        ("contig-f16", np.float16, 2, 2, 2, 2, 7, 5, 13, [5, 9], 1, None, None, {}),
    ]
    cuda_ok = {"contig-f32-gqa-append-leftpad", "paged1-f32-append",
               "paged16-f64-gqa-append-leftpad", "contig-f64-variants", "paged1-f32-mods"}
    cases = []
    for spec in specs:
        def fn(t, spec=spec):
            name, dtype, B, Lq, Hq, H, E, Ev, S, seqlens, new, leftpad, page, kw = spec
            rng = rng_for("kvcache/" + name)
            q = randn(rng, (B, Lq, Hq, E), dtype)
            kc, vc = randn(rng, (B, S, H, E), dtype), randn(rng, (B, S, H, Ev), dtype)
            kn = randn(rng, (B, new, H, E), dtype) if new else None
            vn = randn(rng, (B, new, H, Ev), dtype) if new else None
            kw = dict(kw)
            if "alibi_slopes" in kw:
                kw["alibi_slopes"] = rng.uniform(0.1, 0.9, kw["alibi_slopes"])
            if "sinks" in kw:
                kw["sinks"] = rng.standard_normal(kw["sinks"])
            if kw.pop("mods", False):
                kw["score_mod"], kw["mask_mod"] = tanh_bias_mod, doc_stripes_mask
                kw["mod_args"] = mod_args(t, name, Hq, S, S)[0]
            table = None
            if page:
                kc, vc, table = shuffled_pages(rng, (kc, vc), page)
            dkc, dvc = t.dev(kc), t.dev(vc)
            out, lse = sdpa_numba.attention_with_kvcache(
                t.dev(q), dkc, dvc, np.array(seqlens, np.int32), k=t.dev(kn), v=t.dev(vn),
                block_table=table, cache_leftpad=None if leftpad is None
                else np.array(leftpad, np.int32), return_lse=True, **kw)
            return [t.host(out), t.host(lse), t.host(dkc), t.host(dvc)]
        cases.append((f"kvcache/{spec[0]}", ("cpu", "cuda") if spec[0] in cuda_ok else ("cpu",),
                      fn))
    return cases


def merge_cases():
    import sdpa_numba

    def two(t):
        rng = rng_for("merge/two")
        oa, ob = randn(rng, (2, 3, 7, 5), np.float32), randn(rng, (2, 3, 7, 5), np.float32)
        la = rng.standard_normal((2, 3, 7)).astype(np.float32)
        lb = rng.standard_normal((2, 3, 7)).astype(np.float32)
        la[0, 0, :3] = -np.inf
        lb[0, 0, 1:4] = -np.inf
        out, lse = sdpa_numba.merge_attention_states(t.dev(oa), t.dev(la), t.dev(ob), t.dev(lb))
        return [t.host(out), t.host(lse)]

    def nary(t):
        rng = rng_for("merge/nary")
        outs = randn(rng, (5, 3, 9, 7), np.float64)
        lses = rng.standard_normal((5, 3, 9)) * 3
        lses[1:3, 0] = -np.inf
        lses[:, 1, 2] = -np.inf
        out, lse = sdpa_numba.merge_attention_states(t.dev(outs), t.dev(lses))
        return [t.host(out), t.host(lse)]

    def halves(t):
        # the dense function over two halves of the keys, merged (its documented use)
        rng = rng_for("merge/halves")
        q, k, v = (randn(rng, s, np.float16) for s in ((1, 2, 9, 7), (1, 2, 13, 7),
                                                        (1, 2, 13, 5)))
        a = sdpa_numba.scaled_dot_product_attention(t.dev(q), t.dev(k[..., :6, :]),
                                                    t.dev(v[..., :6, :]), return_lse=True)
        b = sdpa_numba.scaled_dot_product_attention(t.dev(q), t.dev(k[..., 6:, :]),
                                                    t.dev(v[..., 6:, :]), return_lse=True)
        out, lse = sdpa_numba.merge_attention_states(a[0], a[1], b[0], b[1])
        return [t.host(out), t.host(lse)]

    return [("merge/two-f32", ("cpu", "cuda"), two), ("merge/nary-f64", ("cpu", "cuda"), nary),
            ("merge/halves-f16", ("cpu",), halves)]


def all_cases():
    return dense_cases() + varlen_cases() + kvcache_cases() + merge_cases()


def selected(name, only):
    return not only or any(text in name for text in only)


def run_cases(target, verbose=True, only=None):
    t = Target(target)
    hashes = {}
    for name, targets, fn in all_cases():
        full = f"{target}/{name}"
        if target not in targets or not selected(full, only):
            continue
        start = time.monotonic()
        hashes[full] = digest(fn(t))
        if verbose:
            print(f"  ... {full} {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    return hashes


# --------------------------------------------------------------------------------------------
# the ring, under mpiexec -n 2

RING_CASES = [
    # name, dtype, q shape without L, kv heads, L per rank, S per rank, Ev, kwargs
    ("f64-causal-contiguous", np.float64, (2, 3), 3, 5, 5, 6, {"is_causal": True}),
    ("f32-zigzag-gqa", np.float32, (1, 4), 2, 6, 6, 5,
     {"is_causal": True, "layout": "zigzag", "enable_gqa": True}),
    ("f64-noncausal-S7", np.float64, (1, 2), 2, 5, 7, 5, {}),
    ("f64-zigzag-window-softcap-sinks", np.float64, (1, 4), 2, 6, 6, 6,
     {"is_causal": True, "layout": "zigzag", "enable_gqa": True, "window": (2, None),
      "softcap": 2.0, "sinks": True}),
    ("f64-alibi-bottom-right", np.float64, (2, 3), 3, 5, 7, 6,
     {"is_causal": True, "window": (4, 1), "alignment": "bottom_right", "alibi_slopes": True}),
]
RING_CUDA = {"f64-zigzag-window-softcap-sinks", "f64-noncausal-S7"}


def ring_worker(path, target, only):
    from mpi4py import MPI

    from sdpa_numba.distributed import ring_attention, ring_attention_backward, shard

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    t = Target(target)
    hashes = {}
    for name, dtype, qlead, h, nq, nk, ev, kw in RING_CASES:
        if (target == "cuda" and name not in RING_CUDA) or not selected(
                f"{target}/ring/{name}", only):
            continue
        rng = rng_for("ring/" + name)  # the same full inputs on every rank
        E = 6 if target == "cuda" else 7
        L, S = size * nq, size * nk
        q = randn(rng, (*qlead, L, E), dtype)
        k = randn(rng, (qlead[0], h, S, E), dtype)
        v = randn(rng, (qlead[0], h, S, ev), dtype)
        g = randn(rng, (*qlead, L, ev), dtype)
        kw = dict(kw)
        if kw.get("sinks"):
            kw["sinks"] = rng.standard_normal(qlead[-1])
            kw["sinks"][0] = -np.inf
        if kw.get("alibi_slopes"):
            kw["alibi_slopes"] = rng.uniform(0.1, 0.9, qlead[-1])
        layout = kw.get("layout", "contiguous")
        ql, kl, vl, gl = (t.dev(shard(x, comm, layout)) for x in (q, k, v, g))
        out, lse = ring_attention(ql, kl, vl, comm=comm, return_lse=True, **kw)
        grads = ring_attention_backward(gl, ql, kl, vl, out, lse, comm=comm, **kw)
        mine = [t.host(out), t.host(lse), *(t.host(x) for x in grads)]
        every = comm.gather(mine, root=0)
        if comm.Get_rank() == 0:
            hashes[f"{target}/ring/{name}"] = digest([a for rank in every for a in rank])
    if comm.Get_rank() == 0:
        pathlib.Path(path).write_text(json.dumps(hashes))


def mpiexec():
    here = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def run_ring(target, env, only):
    from mpi4py import MPI

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "ring.json"
        cmd = [mpiexec(), *(["-launcher", "fork"] if "MPICH" in MPI.Get_library_version()
                            else ["--oversubscribe"]),
               "-n", "2", sys.executable, __file__, "--_ring", str(path), "--_target", target,
               *only_args(only)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        return json.loads(path.read_text())


def child_env(cuda):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if cuda:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def only_args(only):
    return [a for text in only or () for a in ("--only", text)]


def run_cuda_subprocess(only):
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "cuda.json"
        cmd = [sys.executable, __file__, "--_cuda", str(path), *only_args(only)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(True),
                              cwd=ROOT, timeout=1800)
        sys.stderr.write(proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        return json.loads(path.read_text())


# --------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the hashes (JSON) to this file")
    ap.add_argument("--compare", help="compare with the hashes of this file (exit 1 on a "
                                      "difference)")
    ap.add_argument("--cpu-only", action="store_true", help="no CUDA-simulator cases")
    ap.add_argument("--no-ring", action="store_true", help="no mpiexec ring cases")
    ap.add_argument("--only", action="append", metavar="TEXT",
                    help="run only the cases whose name contains TEXT (repeatable), e.g. "
                         "kvcache/ or ring/")
    ap.add_argument("--quiet", action="store_true", help="no per-case timings on stderr")
    ap.add_argument("--_cuda", help=argparse.SUPPRESS)
    ap.add_argument("--_ring", help=argparse.SUPPRESS)
    ap.add_argument("--_target", default="cpu", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._cuda:  # the CUDA-simulator subprocess
        hashes = run_cases("cuda", not args.quiet, args.only)
        pathlib.Path(args._cuda).write_text(json.dumps(hashes))
        return 0
    if args._ring:  # a rank under mpiexec
        ring_worker(args._ring, args._target, args.only)
        return 0
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        ap.error("run without NUMBA_ENABLE_CUDASIM: the CUDA cases run in a subprocess")

    import sdpa_numba

    print(f"sdpa_numba from {pathlib.Path(sdpa_numba.__file__).parent}", file=sys.stderr)
    start = time.monotonic()
    hashes = run_cases("cpu", not args.quiet, args.only)
    if not args.no_ring:
        hashes.update(run_ring("cpu", child_env(False), args.only))
    if not args.cpu_only:
        hashes.update(run_cuda_subprocess(args.only))
        if not args.no_ring:
            hashes.update(run_ring("cuda", child_env(True), args.only))
    for name in sorted(hashes):
        print(f"{name:60} {hashes[name][:16]}")
    total = combined(hashes)
    print(f"{'combined (' + str(len(hashes)) + ' cases)':60} {total[:16]}  {total}")
    print(f"time {time.monotonic() - start:.0f} s", file=sys.stderr)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            {"combined": total, "cases": hashes,
             "numba_num_threads": os.environ.get("NUMBA_NUM_THREADS")}, indent=1,
            sort_keys=True) + "\n")
    if args.compare:
        before = json.loads(pathlib.Path(args.compare).read_text())["cases"]
        differ = sorted(n for n in set(before) & set(hashes) if before[n] != hashes[n])
        only_before = sorted(set(before) - set(hashes))
        only_now = sorted(set(hashes) - set(before))
        for n in differ:
            print(f"DIFFERS  {n}: {before[n][:16]} -> {hashes[n][:16]}")
        for n in only_before:
            print(f"MISSING  {n} (in {args.compare}, not run now)")
        for n in only_now:
            print(f"NEW      {n} (not in {args.compare})")
        same = len(set(before) & set(hashes)) - len(differ)
        print(f"compare: {same} same, {len(differ)} differ, {len(only_before)} missing, "
              f"{len(only_now)} new")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
