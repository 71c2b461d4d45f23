"""The ring attention cases and checks shared by the MPI worker (tests/mpi_ring_worker.py)
and the torch.distributed worker (tests/torch_ring_worker.py): the same inputs, the same
comparisons with the single-process dense functions, the same error cases, over either
kind of communicator (not collected by pytest).

``ranks``: the worker's view of its communicator: ``comm`` (what the ring functions get),
``size``, ``rank``, ``allgather(obj)`` (every rank's object, in rank order), and ``wrap``/
``unwrap`` (NumPy arrays to the kind the ring is given, and back: torch tensors for torch).
"""

import functools
import hashlib
import zlib

import numpy as np

import sdpa_numba
from sdpa_numba import distributed
from sdpa_numba.distributed import ring_attention, ring_attention_backward, shard, unshard

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


def inputs(case, P):
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


def run_case(ranks, case):
    """One case on every rank; rank 0's report (None on the others)."""
    comm, wrap, unwrap = ranks.comm, ranks.wrap, ranks.unwrap
    name, dt, causal, layout, qlead, h, kvbatch, n_q, n_k, ev = case[:10]
    q, k, v, rng, variants = inputs(case, ranks.size)
    gqa = h is not None and qlead[-1] != h
    ref_out, ref_lse = sdpa_numba.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=gqa, return_lse=True, **variants)
    g = rng.standard_normal(ref_out.shape).astype(dt)
    ref_grads = sdpa_numba.scaled_dot_product_attention_backward(
        g, q, k, v, ref_out, ref_lse, is_causal=causal, enable_gqa=gqa, **variants)

    ql, kl, vl, gl = (wrap(shard(x, comm, layout)) for x in (q, k, v, g))
    kl_before = unwrap(kl).copy()
    out, lse = ring_attention(ql, kl, vl, comm=comm, is_causal=causal, layout=layout,
                              enable_gqa=gqa, return_lse=True, **variants)
    # Run twice: bitwise the same (fixed merge and accumulation orders).
    again = ring_attention(ql, kl, vl, comm=comm, is_causal=causal, layout=layout,
                           enable_gqa=gqa, **variants)
    grads = ring_attention_backward(gl, ql, kl, vl, out, lse, comm=comm, is_causal=causal,
                                    layout=layout, enable_gqa=gqa, **variants)
    grads_again = ring_attention_backward(gl, ql, kl, vl, out, lse, comm=comm,
                                          is_causal=causal, layout=layout, enable_gqa=gqa,
                                          **variants)
    kinds = [type(x).__name__ for x in (out, lse, again, *grads[:3], *grads_again[:3])]
    out, lse, again = unwrap(out), unwrap(lse), unwrap(again)
    grads = [unwrap(x) for x in grads]
    grads_again = [unwrap(x) for x in grads_again]
    full = {"out": unshard(out, comm, layout), "lse": unshard(lse, comm, layout, axis=-1),
            "dq": unshard(grads[0], comm, layout), "dk": unshard(grads[1], comm, layout),
            "dv": unshard(grads[2], comm, layout)}
    ref = {"out": ref_out, "lse": ref_lse, "dq": ref_grads[0], "dk": ref_grads[1],
           "dv": ref_grads[2]}
    if "sinks" in variants:  # the whole gradient of the sinks, on every rank
        full["dsinks"], ref["dsinks"] = grads[3], ref_grads[3]
        same = ranks.allgather(grads[3].tobytes())
        full["dsinks_same_on_every_rank"] = all(x == same[0] for x in same)
    local_ok = {
        "bitwise_repeat_forward": bool(np.array_equal(out, again)),
        "bitwise_repeat_backward": all(np.array_equal(a, b) for a, b in zip(grads, grads_again)),
        "inputs_unchanged": bool(np.array_equal(unwrap(kl), kl_before)),
        "kinds": kinds,
        "dtypes": [str(out.dtype), str(lse.dtype), *(str(x.dtype) for x in grads)],
        "finite": bool(all(np.isfinite(x).all() for x in (out, *grads))
                       and not np.isnan(lse).any() and not (lse == np.inf).any()),
    }
    oks = ranks.allgather(local_ok)
    if ranks.rank:
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


def error_cases(ranks):
    """What every rank raised in each error case (the list on every rank)."""
    P, rank, wrap = ranks.size, ranks.rank, ranks.wrap
    ring_attention = functools.partial(distributed.ring_attention, comm=ranks.comm)
    ring_attention_backward = functools.partial(distributed.ring_attention_backward,
                                                comm=ranks.comm)

    def expect_error(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded and compared by the test
            result = [type(e).__name__, str(e)]
        else:
            result = None
        return ranks.allgather(result)

    rng = np.random.default_rng(1)
    q = wrap(rng.standard_normal((2, 6, 8)))
    k = wrap(rng.standard_normal((2, 6, 8)))
    v = wrap(rng.standard_normal((2, 6, 8)))
    errors = {}
    # Shapes differ across ranks (the last rank's shard is shorter).
    qb = q[:, :4] if rank == P - 1 else q
    kb = k[:, :4] if rank == P - 1 else k
    errors["shapes_differ"] = expect_error(
        lambda: ring_attention(qb, kb, v if rank != P - 1 else v[:, :4], is_causal=True))
    errors["odd_zigzag"] = expect_error(
        lambda: ring_attention(q[:, :5], k[:, :5], v[:, :5], layout="zigzag"))
    errors["bad_on_one_rank"] = expect_error(
        lambda: ring_attention(q if rank else wrap(ranks.unwrap(q).astype(np.float32)), k, v))
    errors["bad_on_last_rank"] = expect_error(
        lambda: ring_attention(q, k if rank != P - 1 else wrap(ranks.unwrap(k)[:, :, :4]), v))
    errors["bad_flag_on_one_rank"] = expect_error(
        lambda: ring_attention(q, k, v, return_lse="yes" if rank == 0 else True))
    errors["score_mod"] = expect_error(
        lambda: ring_attention(q, k, v, score_mod=lambda s, b, h, i, j: s))
    errors["bad_window"] = expect_error(lambda: ring_attention(q, k, v, window=(-1, 0)))
    errors["sinks_differ"] = expect_error(
        lambda: ring_attention(q, k, v, sinks=np.full(2, float(rank == P - 1))))
    errors["attn_mask"] = expect_error(
        lambda: ring_attention(q, k, v, attn_mask=wrap(np.ones((6, 6), bool))))
    errors["dropout"] = expect_error(lambda: ring_attention(q, k, v, dropout_p=0.1))
    errors["unknown_kwarg"] = expect_error(lambda: ring_attention(q, k, v, windw=(2, 0)))
    errors["bad_layout"] = expect_error(lambda: ring_attention(q, k, v, layout="striped"))
    errors["bad_lse_backward"] = expect_error(
        lambda: ring_attention_backward(q, q, k, v, q, wrap(np.zeros((2, 6), np.float32))))
    # The variants at their "off" values are accepted (and give the plain result).
    plain = ring_attention(q, k, v, is_causal=True)
    off = ring_attention(q, k, v, is_causal=True, window=None, alignment="top_left",
                         softcap=None, attn_mask=None, dropout_p=0.0)
    errors["variants_off_ok"] = ranks.allgather(bool(np.array_equal(plain, off)))

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
    errors["usable_after"] = ranks.allgather(bool(np.array_equal(after, before)))
    return errors


def shard_roundtrip(ranks):
    comm, P, rank = ranks.comm, ranks.size, ranks.rank
    x = np.arange(2 * P * 2 * 3 * 4, dtype=np.float32).reshape(2, P * 2 * 3, 4)
    result = {}
    for layout in distributed.LAYOUTS:
        local = shard(x, comm, layout)
        rows = distributed.shard_rows(x.shape[1], P, rank, layout)
        ok = bool(np.array_equal(local, x[:, rows]) and np.array_equal(unshard(local, comm,
                                                                               layout), x))
        result[layout] = ranks.allgather(ok)
    return result


# What the tests of both transports check (tests/test_distributed.py and
# tests/test_distributed_torch.py).

#: float16: partial outputs and gradients are rounded to float16 before they are combined
#: (measured here: 3e-4 against the single process, which is 2e-4 from the float64 reference).
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-3}
#: The cases with sinks: the ring adds them once per row after the last step (a merge), the
#: dense kernel inside its softmax, so a single rank is not bitwise the dense result there.
SINKS = {"f64-var-causal-zigzag-window-softcap-sinks", "f64-var-zigzag-window-alibi-sinks-L>S"}


# The error cases: (kind every rank raises, a phrase of the message).
ERRORS = {
    "odd_zigzag": ("ValueError", "zigzag layout needs shards of even length"),
    "attn_mask": ("ValueError", "no dense attn_mask"),
    "score_mod": ("NotImplementedError", "does not shard score_mod"),
    "bad_window": ("ValueError", "window's left side must be >= 0"),
    "dropout": ("NotImplementedError", "no dropout"),
    "unknown_kwarg": ("TypeError", "windw"),
    "bad_layout": ("ValueError", "layout must be one of"),
    "bad_lse_backward": ("ValueError", "lse must have shape"),
    "bad_on_one_rank": ("TypeError", "key dtype float64 differs from query dtype float32"),
    "bad_flag_on_one_rank": ("TypeError", "return_lse must be a bool"),
    "bad_on_last_rank": ("ValueError", "key's last dim must equal query's"),
    "midway_forward": ("RuntimeError", "injected failure"),
    "midway_backward": ("RuntimeError", "injected failure"),
}


def warm():
    """Compile or load every kernel specialization the ranks use, once, in this process."""
    for dt in (np.float16, np.float32, np.float64):
        q = np.ones((1, 1, 3, 4), dt)
        o, lse = sdpa_numba.scaled_dot_product_attention(q, q, q, return_lse=True)
        sdpa_numba.scaled_dot_product_attention_backward(o, q, q, q, o, lse)
        sdpa_numba.merge_attention_states(o, lse, o, lse)
    # ALiBi is another kernel specialization (float64 only in the worker's cases).
    q = np.ones((1, 1, 3, 4))
    o, lse = sdpa_numba.scaled_dot_product_attention(q, q, q, return_lse=True,
                                                     alibi_slopes=np.ones(1))
    sdpa_numba.scaled_dot_product_attention_backward(o, q, q, q, o, lse, alibi_slopes=np.ones(1))


def check_case(r, case, dtype, n, kinds=None):
    """The checks of one case's report (the same for every transport): the gathered results
    within the dtype's tolerance of the single process (bitwise for one rank, sinks apart),
    the sinks' gradient the same on every rank, and on every rank finite results, inputs
    unchanged, bitwise repeats, the reference's dtypes and (``kinds``) the results' types."""
    keys = ("out", "lse", "dq", "dk", "dv") + (("dsinks",) if case in SINKS else ())
    errors = {key: r[key] for key in keys}
    assert r["shapes_match"]
    assert all(e <= TOL[dtype] for e in errors.values()), errors
    assert r["dsinks_same_on_every_rank"] is (True if case in SINKS else None)
    if n == 1 and case not in SINKS:  # a communicator of size 1 is plain attention: bitwise
        assert all(e == 0 for e in errors.values()), errors
    for rank, ok in enumerate(r["ranks"]):
        assert ok["finite"], rank
        assert ok["inputs_unchanged"], rank
        assert ok["bitwise_repeat_forward"] and ok["bitwise_repeat_backward"], rank
        assert ok["dtypes"] == r["ref_dtypes"], rank
        if kinds is not None:
            assert ok["kinds"] == [kinds] * len(ok["kinds"]), (rank, ok["kinds"])


def check_error(errors, n, name):
    """Every one of the ``n`` ranks raised the case's kind of exception, with its phrase."""
    kind, phrase = ERRORS[name]
    got = errors[name]
    assert len(got) == n
    for rank, e in enumerate(got):
        assert e is not None, f"rank {rank} did not raise"
        assert e[0] == kind and phrase in e[1], (rank, e)


def check_failing_rank_named(errors, n):
    """The failing rank raises its own exception; the others name it."""
    for name, failing in (("bad_on_one_rank", 0), ("bad_flag_on_one_rank", 0),
                          ("bad_on_last_rank", n - 1), ("midway_forward", n - 1),
                          ("midway_backward", n - 1)):
        for rank, (_, message) in enumerate(errors[name]):
            if rank != failing:
                assert f"rank {failing} raised" in message, (name, rank, message)
            else:
                assert "rank" not in message, (name, rank, message)  # its own exception


def check_refused_everywhere(errors, n):
    """Shapes and sinks that differ across ranks: ValueError on every rank."""
    assert len(errors["shapes_differ"]) == n and len(errors["sinks_differ"]) == n
    for e in errors["shapes_differ"]:
        assert e is not None and e[0] == "ValueError"
        assert "same shapes" in e[1] and f"rank {n - 1} has query (2, 4, 8)" in e[1]
    for e in errors["sinks_differ"]:
        assert e is not None and e[0] == "ValueError" and "sinks=" in e[1], e
