"""Run under ``mpiexec -n P`` by tests/test_distributed.py (not collected by pytest).

Every rank builds the same full inputs, shards them, runs ring attention forward and backward,
and gathers the results; rank 0 compares them with the single-process dense functions on the
full arrays and writes a JSON report (relative Frobenius errors, bitwise checks, and what each
rank raised in the error cases) to the path given as the first argument.
"""

import hashlib
import json
import sys
import zlib

import numpy as np
from mpi4py import MPI

import sdpa_numba
from sdpa_numba import distributed
from sdpa_numba.distributed import (ring_attention, ring_attention_backward, shard,
                                    unshard)

comm = MPI.COMM_WORLD
P, rank = comm.Get_size(), comm.Get_rank()

#: (name, dtype, is_causal, layout, q shape without L, kv heads, batch of k/v, n_q, n_k, Ev):
#: shard lengths are odd where the layout allows (zigzag shards are two chunks: 2 x odd).
CASES = [
    ("f64-causal-contiguous", "float64", True, "contiguous", (2, 3), 3, (2,), 5, 5, 6),
    ("f64-noncausal-contiguous-S7", "float64", False, "contiguous", (1, 2), 2, (1,), 5, 7, 5),
    ("f64-causal-zigzag-gqa", "float64", True, "zigzag", (1, 4), 2, (1,), 6, 6, 6),
    ("f64-causal-zigzag-2d", "float64", True, "zigzag", (), None, (), 6, 6, 3),
    ("f64-noncausal-zigzag-bcast", "float64", False, "zigzag", (2, 2), 2, (1,), 6, 10, 4),
    ("f32-causal-zigzag", "float32", True, "zigzag", (2, 2), 2, (2,), 6, 6, 8),
    ("f32-noncausal-zigzag-gqa", "float32", False, "zigzag", (1, 6), 2, (1,), 10, 6, 8),
    ("f32-causal-contiguous-gqa", "float32", True, "contiguous", (1, 4), 1, (1,), 7, 7, 8),
    ("f16-causal-zigzag", "float16", True, "zigzag", (1, 2), 2, (1,), 10, 10, 8),
    # The variants (float64), over global positions: a causal window narrower than a zigzag
    # chunk (whole ring steps skipped at 3 and 4 ranks) with a soft cap and sinks (one head
    # without: -inf); ALiBi with a window and bottom-right causality over L != S; a
    # top-left window over L > S (the last rows see no key: out 0, lse -inf), per-batch
    # ALiBi slopes and sinks, zigzag.
    ("f64-var-causal-zigzag-window-softcap-sinks", "float64", True, "zigzag", (1, 4), 2,
     (1,), 6, 6, 6, {"window": (2, None), "softcap": 2.0, "sinks": "sinks"}),
    ("f64-var-causal-contiguous-alibi-bottomright", "float64", True, "contiguous", (2, 3), 3,
     (2,), 5, 7, 6, {"window": (4, 1), "alignment": "bottom_right", "alibi_slopes": (3,)}),
    ("f64-var-zigzag-window-alibi-sinks-L>S", "float64", False, "zigzag", (2, 2), 2, (1,),
     8, 4, 4, {"window": (1, 0), "alibi_slopes": (2, 2), "sinks": "sinks"}),
]
E = 8


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return float("inf")
    same = a == b  # equal infinities (lse of rows that see no key) count as no error
    a, b = np.where(same, 0.0, a), np.where(same, 0.0, b)
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (den if den > 0 else 1.0))


def inputs(case):
    name, dt, causal, layout, qlead, h, kvbatch, n_q, n_k, ev = case[:10]
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # the same on every rank
    L, S = P * n_q, P * n_k
    if h is None:  # 2-D inputs (L, E)
        qs, ks, vs = (L, E), (S, E), (S, ev)
    else:
        qs = (*qlead, L, E)
        ks, vs = (*kvbatch, h, S, E), (*kvbatch, h, S, ev)
    q = rng.standard_normal(qs).astype(dt)
    k = rng.standard_normal(ks).astype(dt)
    v = rng.standard_normal(vs).astype(dt)
    variants = {}
    for key, value in (case[10] if len(case) > 10 else {}).items():
        if key == "alibi_slopes":
            value = rng.uniform(0.1, 0.8, value)
        elif key == "sinks":
            value = rng.standard_normal(q.shape[-3])
            value[0] = -np.inf
        variants[key] = value
    return q, k, v, rng, variants


def run_case(case):
    name, dt, causal, layout, qlead, h, kvbatch, n_q, n_k, ev = case[:10]
    q, k, v, rng, variants = inputs(case)
    gqa = h is not None and qlead[-1] != h
    ref_out, ref_lse = sdpa_numba.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=gqa, return_lse=True, **variants)
    g = rng.standard_normal(ref_out.shape).astype(dt)
    ref_grads = sdpa_numba.scaled_dot_product_attention_backward(
        g, q, k, v, ref_out, ref_lse, is_causal=causal, enable_gqa=gqa, **variants)

    ql, kl, vl, gl = (shard(x, comm, layout) for x in (q, k, v, g))
    kl_before = kl.copy()
    out, lse = ring_attention(ql, kl, vl, is_causal=causal, layout=layout, enable_gqa=gqa,
                              return_lse=True, **variants)
    # Run twice: bitwise the same (fixed merge and accumulation orders).
    again = ring_attention(ql, kl, vl, is_causal=causal, layout=layout, enable_gqa=gqa,
                           **variants)
    grads = ring_attention_backward(gl, ql, kl, vl, out, lse, is_causal=causal,
                                    layout=layout, enable_gqa=gqa, **variants)
    grads_again = ring_attention_backward(gl, ql, kl, vl, out, lse, is_causal=causal,
                                          layout=layout, enable_gqa=gqa, **variants)
    full = {"out": unshard(out, comm, layout), "lse": unshard(lse, comm, layout, axis=-1),
            "dq": unshard(grads[0], comm, layout), "dk": unshard(grads[1], comm, layout),
            "dv": unshard(grads[2], comm, layout)}
    ref = {"out": ref_out, "lse": ref_lse, "dq": ref_grads[0], "dk": ref_grads[1],
           "dv": ref_grads[2]}
    if "sinks" in variants:  # the whole gradient of the sinks, on every rank
        full["dsinks"], ref["dsinks"] = grads[3], ref_grads[3]
        same = comm.allgather(grads[3].tobytes())
        full["dsinks_same_on_every_rank"] = all(x == same[0] for x in same)
    local_ok = {
        "bitwise_repeat_forward": bool(np.array_equal(out, again)),
        "bitwise_repeat_backward": all(np.array_equal(a, b) for a, b in zip(grads, grads_again)),
        "inputs_unchanged": bool(np.array_equal(kl, kl_before)),
        "dtypes": [str(out.dtype), str(lse.dtype), *(str(x.dtype) for x in grads)],
        "finite": bool(all(np.isfinite(x).all() for x in (out, *grads))
                       and not np.isnan(lse).any() and not (lse == np.inf).any()),
    }
    oks = comm.gather(local_ok, root=0)
    if rank:
        return None
    report = {key: rel(full[key], ref[key]) for key in ref}
    report["dsinks_same_on_every_rank"] = full.pop("dsinks_same_on_every_rank", None)
    # The bits of every gathered result, to compare runs with other thread counts.
    report["sha256"] = hashlib.sha256(b"".join(full[key].tobytes() for key in sorted(full)))\
        .hexdigest()
    report["shapes_match"] = all(full[key].shape == ref[key].shape for key in full)
    report["ranks"] = oks
    report["ref_dtypes"] = [str(ref_out.dtype), str(ref_lse.dtype),
                            *(str(x.dtype) for x in ref_grads)]
    return report


def expect_error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded and compared by the test
        result = [type(e).__name__, str(e)]
    else:
        result = None
    return comm.gather(result, root=0)


def error_cases():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 6, 8))
    k = rng.standard_normal((2, 6, 8))
    v = rng.standard_normal((2, 6, 8))
    errors = {}
    # Shapes differ across ranks (the last rank's shard is shorter).
    qb = q[:, :4] if rank == P - 1 else q
    kb = k[:, :4] if rank == P - 1 else k
    errors["shapes_differ"] = expect_error(
        lambda: ring_attention(qb, kb, v if rank != P - 1 else v[:, :4], is_causal=True))
    errors["odd_zigzag"] = expect_error(
        lambda: ring_attention(q[:, :5], k[:, :5], v[:, :5], layout="zigzag"))
    errors["bad_on_one_rank"] = expect_error(
        lambda: ring_attention(q if rank else q.astype(np.float32), k, v))
    errors["bad_flag_on_one_rank"] = expect_error(
        lambda: ring_attention(q, k, v, return_lse="yes" if rank == 0 else True))
    errors["score_mod"] = expect_error(
        lambda: ring_attention(q, k, v, score_mod=lambda s, b, h, i, j: s))
    errors["bad_window"] = expect_error(lambda: ring_attention(q, k, v, window=(-1, 0)))
    errors["sinks_differ"] = expect_error(
        lambda: ring_attention(q, k, v, sinks=np.full(2, float(rank == P - 1))))
    errors["attn_mask"] = expect_error(
        lambda: ring_attention(q, k, v, attn_mask=np.ones((6, 6), bool)))
    errors["dropout"] = expect_error(lambda: ring_attention(q, k, v, dropout_p=0.1))
    errors["unknown_kwarg"] = expect_error(lambda: ring_attention(q, k, v, windw=(2, 0)))
    errors["bad_layout"] = expect_error(lambda: ring_attention(q, k, v, layout="striped"))
    errors["bad_lse_backward"] = expect_error(
        lambda: ring_attention_backward(q, q, k, v, q, np.zeros((2, 6), np.float32)))
    # The variants at their "off" values are accepted (and give the plain result).
    plain = ring_attention(q, k, v, is_causal=True)
    off = ring_attention(q, k, v, is_causal=True, window=None, alignment="top_left",
                         softcap=None, attn_mask=None, dropout_p=0.0)
    errors["variants_off_ok"] = comm.gather(bool(np.array_equal(plain, off)), root=0)

    before = ring_attention(q, k, v)
    # A rank failing midway (its second kernel call: ring step 1 when P > 1) stops everyone.
    from sdpa_numba.distributed import ring_backward, ring_forward

    real = ring_forward._attend
    real_bwd = ring_backward._attend_backward
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if rank == P - 1 and calls[0] == min(2, P):
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    def failing_bwd(*args, **kwargs):
        calls[0] += 1
        if rank == P - 1 and calls[0] == min(2, P):
            raise RuntimeError("injected failure")
        return real_bwd(*args, **kwargs)

    ring_forward._attend = failing
    try:
        errors["midway_forward"] = expect_error(lambda: ring_attention(q, k, v))
    finally:
        ring_forward._attend = real
    out, lse = ring_attention(q, k, v, return_lse=True)
    calls[0] = 0
    ring_backward._attend_backward = failing_bwd
    try:
        errors["midway_backward"] = expect_error(
            lambda: ring_attention_backward(q, q, k, v, out, lse))
    finally:
        ring_backward._attend_backward = real_bwd
    # The communicator still works after all of that.
    after = ring_attention(q, k, v)
    errors["usable_after"] = comm.gather(bool(np.array_equal(after, before)), root=0)
    return errors


def shard_roundtrip():
    x = np.arange(2 * P * 2 * 3 * 4, dtype=np.float32).reshape(2, P * 2 * 3, 4)
    result = {}
    for layout in distributed.LAYOUTS:
        local = shard(x, comm, layout)
        rows = distributed.shard_rows(x.shape[1], P, rank, layout)
        ok = bool(np.array_equal(local, x[:, rows]) and np.array_equal(unshard(local, comm,
                                                                               layout), x))
        result[layout] = comm.gather(ok, root=0)
    return result


#: Device cases (``--cuda``, under the CUDA simulator: host staging), tiny: the simulator runs
#: every GPU thread in Python. (name, dtype, is_causal, layout, variants).
CUDA_CASES = [
    ("cuda-f64-causal-zigzag-gqa-window-softcap-sinks", "float64", True, "zigzag",
     {"window": (3, None), "softcap": 2.0, "sinks": True}),
    ("cuda-f32-noncausal-contiguous", "float32", False, "contiguous", {}),
]


def run_cuda_case(case):
    """Ring attention on device arrays (forward and backward) against the same call on the
    host arrays (the host ring) and against the single-process dense functions."""
    from numba import cuda

    name, dt, causal, layout, spec = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    gqa = bool(spec.get("sinks"))  # GQA in the first case: 4 query heads on 2 kv heads
    hq, h = (4, 2) if gqa else (2, 2)
    L = P * 4
    q = rng.standard_normal((hq, L, 4)).astype(dt)
    k = rng.standard_normal((h, L, 4)).astype(dt)
    v = rng.standard_normal((h, L, 3)).astype(dt)
    variants = {key: value for key, value in spec.items() if key != "sinks"}
    if spec.get("sinks"):
        variants["sinks"] = rng.standard_normal(hq)
        variants["sinks"][0] = -np.inf
    kw = dict(is_causal=causal, layout=layout, enable_gqa=gqa, **variants)
    ql, kl, vl = (shard(x, comm, layout) for x in (q, k, v))
    out_h, lse_h = ring_attention(ql, kl, vl, return_lse=True, **kw)
    g = rng.standard_normal(out_h.shape).astype(dt)
    grads_h = ring_attention_backward(g, ql, kl, vl, out_h, lse_h, **kw)
    dev = [cuda.to_device(np.ascontiguousarray(x)) for x in (ql, kl, vl, g)]
    out_d, lse_d = ring_attention(*dev[:3], return_lse=True, **kw)
    grads_d = ring_attention_backward(dev[3], *dev[:3], out_d, lse_d, **kw)
    host = [x.copy_to_host() for x in (out_d, lse_d, *grads_d[:3])]
    local = {"device_results": all(hasattr(x, "copy_to_host") for x in (out_d, lse_d,
                                                                         *grads_d[:3])),
             "kinds": [type(x).__name__ for x in (out_d, *grads_d)],
             "vs_host_ring": max(rel(a, b) for a, b in zip(host, (out_h, lse_h, *grads_h[:3]))),
             "dsinks_vs_host_ring": (rel(grads_d[3], grads_h[3]) if len(grads_h) > 3
                                     else None),
             "inputs_unchanged": bool(np.array_equal(dev[1].copy_to_host(), kl))}
    ref_out, ref_lse = sdpa_numba.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=gqa, return_lse=True, **variants)
    ref_grads = sdpa_numba.scaled_dot_product_attention_backward(
        g_full := unshard(g, comm, layout), q, k, v, ref_out, ref_lse, is_causal=causal,
        enable_gqa=gqa, **variants)
    del g_full
    full = [unshard(host[0], comm, layout), unshard(host[1], comm, layout, axis=-1),
            *(unshard(x, comm, layout) for x in host[2:])]
    local["vs_dense"] = max(rel(a, b) for a, b in zip(full, (ref_out, ref_lse,
                                                             *ref_grads[:3])))
    return comm.gather(local, root=0)


def main_cuda(path):
    from sdpa_numba.gpu.arrays import is_simulated_mode

    report = {"size": P, "simulated": is_simulated_mode(),
              "cuda_aware": distributed.mpi_cuda_aware(), "cases": {}}
    for case in CUDA_CASES:
        report["cases"][case[0]] = run_cuda_case(case)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def main():
    path = sys.argv[1]
    if "--cuda" in sys.argv[2:]:
        return main_cuda(path)
    import numba

    report = {"size": P, "cases": {}, "threads": numba.get_num_threads()}
    for case in CASES:
        r = run_case(case)
        if rank == 0:
            report["cases"][case[0]] = r
    report["errors"] = error_cases()
    report["shard_roundtrip"] = shard_roundtrip()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
