"""kvcache_plan: one decode step planned once and run for every layer, bit for bit as
attention_with_kvcache; a run checks that its arrays are the plan's, before anything is
written."""

import numpy as np
import pytest

import sdpa_numba
from kvcache_checks import paged_pair
from sdpa_numba import attention_with_kvcache as kvattn
from sdpa_numba import kvcache_plan
from sdpa_numba.cpu.decode import CHUNK


def layers(rng, n, B, Lq, Hq, H, E, Ev, S, new=0, dtype=np.float64):
    """``n`` layers' (q, k_cache, v_cache, k, v) of one step."""
    out = []
    for _ in range(n):
        q = rng.standard_normal((B, Lq, Hq, E)).astype(dtype)
        kc = rng.standard_normal((B, S, H, E)).astype(dtype)
        vc = rng.standard_normal((B, S, H, Ev)).astype(dtype)
        k = rng.standard_normal((B, new, H, E)).astype(dtype) if new else None
        v = rng.standard_normal((B, new, H, Ev)).astype(dtype) if new else None
        out.append([q, kc, vc, k, v])
    return out


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("new", [0, 2])
def test_one_plan_runs_every_layer_as_the_one_shot_call(rng, page_size, new):
    B, Lq, Hq, H, E, Ev, S = 3, 2, 4, 2, 6, 5, CHUNK + 40
    ls = layers(rng, 3, B, Lq, Hq, H, E, Ev, S, new)
    table = None
    for layer in ls:  # one block table for every layer, as a serving engine keeps them
        layer[1], layer[2], t = paged_pair(np.random.default_rng(1), layer[1], layer[2],
                                           page_size)
        table = t if table is None else table
    seqlens = np.array([CHUNK + 30, 0, 17])
    leftpad = np.array([3, 0, 2])
    kw = dict(block_table=table, cache_leftpad=leftpad, window=(40, 0), softcap=5.0)
    copies = [[None if x is None else x.copy() for x in layer] for layer in ls]
    q0, kc0, vc0, k0, v0 = ls[0]
    plan = kvcache_plan(q0, kc0, vc0, seqlens, k=k0, v=v0, **kw)
    assert isinstance(plan, sdpa_numba.KVCachePlan)
    np.testing.assert_array_equal(kc0, copies[0][1])  # planning writes nothing
    for layer, copy in zip(ls, copies):
        q, kc, vc, k, v = layer
        out = np.full((B, Lq, Hq, Ev), np.nan)
        res, lse = plan.run(q, kc, vc, k=k, v=v, out=out, return_lse=True)
        assert res is out
        cq, ckc, cvc, ck, cv = copy
        want, want_lse = kvattn(cq, ckc, cvc, seqlens, k=ck, v=cv, return_lse=True, **kw)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(lse, want_lse)
        np.testing.assert_array_equal(kc, ckc)  # the same slots appended
        np.testing.assert_array_equal(vc, cvc)
        np.testing.assert_array_equal(plan.run(q, kc, vc, k=k, v=v) if not new
                                      else want, want)


def test_a_plan_keeps_its_own_copy_of_the_lengths_and_the_table(rng):
    (q, kc, vc, _, _), = layers(rng, 1, 2, 1, 2, 2, 4, 4, 12)
    kc, vc, table = paged_pair(rng, kc, vc, 4)
    seqlens = np.array([9, 5])
    plan = kvcache_plan(q, kc, vc, seqlens, block_table=table)
    want = plan.run(q, kc, vc)
    seqlens[:] = 0
    table[:] = table[::-1].copy()
    np.testing.assert_array_equal(plan.run(q, kc, vc), want)


def test_a_plan_appends_once_per_cache(rng):
    # The plan is for one step: a second append into the same cache would write the same slots
    # again, not the next ones; the next step needs its own plan.
    (q, kc, vc, k, v), (q1, kc1, vc1, k1, v1) = layers(rng, 2, 2, 1, 2, 2, 4, 4, 12, new=1)
    seqlens = np.array([3, 7])
    plan = kvcache_plan(q, kc, vc, seqlens, k=k, v=v)
    plan.run(q, kc, vc, k=k, v=v)
    plan.run(q1, kc1, vc1, k=k1, v=v1)  # another layer's cache: fine
    before = kc.copy(), vc.copy()
    with pytest.raises(ValueError, match="already appended into this k_cache"):
        plan.run(q, kc, vc, k=k, v=v)
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])
    nxt = kvcache_plan(q, kc, vc, seqlens + 1, k=k, v=v)
    nxt.run(q, kc, vc, k=k, v=v)
    np.testing.assert_array_equal(kc[0, 4], k[0, 0])


def test_a_run_refuses_arrays_that_are_not_the_plans(rng):
    (q, kc, vc, k, v), = layers(rng, 1, 2, 1, 4, 2, 4, 3, 12, new=1)
    seqlens = np.array([3, 7])
    plan = kvcache_plan(q, kc, vc, seqlens, k=k, v=v)
    read = kvcache_plan(q, kc, vc, seqlens)
    inputs = (q, kc, vc, k, v)
    before = [x.copy() for x in inputs]

    def refused(exc, match, p, *args, **kw):
        with pytest.raises(exc, match=match):
            p.run(*args, **kw)
        for x, c in zip(inputs, before):
            np.testing.assert_array_equal(x, c)

    refused(ValueError, r"^q of shape \(2, 2, 4, 4\) .* not what the plan was made for", read,
            np.concatenate([q, q], 1), kc, vc)
    refused(ValueError, r"^k_cache of shape \(2, 11, 2, 4\)", read, q, kc[:, 1:], vc)
    refused(ValueError, "^v_cache .* dtype float32", read, q, kc, vc.astype(np.float32))
    refused(ValueError, "k and v must be given exactly when the plan was made with them",
            plan, q, kc, vc)
    refused(ValueError, "k and v must be given exactly", read, q, kc, vc, k=k, v=v)
    refused(ValueError, "k and v must be given exactly", plan, q, kc, vc, k=k)
    refused(ValueError, r"^k of shape \(2, 2, 2, 4\)", plan, q, kc, vc,
            k=np.concatenate([k, k], 1), v=v)
    strided = np.zeros((2, 12, 2, 8))[..., ::2]
    refused(ValueError, "k_cache's last dim must be contiguous", read, q, strided, vc)
    refused(ValueError, "out must have shape", plan, q, kc, vc, k=k, v=v,
            out=np.empty((2, 1, 4, 4)))
    refused(ValueError, "out overlaps k_cache", read, q, kc, vc, out=kc.reshape(-1)[:24].reshape(2, 1, 4, 3))
    kc.flags.writeable = False
    refused(ValueError, "^k_cache must be writeable", plan, q, kc, vc, k=k, v=v)
    read.run(q, kc, vc)  # read-only is fine without an append
    refused(TypeError, "return_lse must be a bool", read, q, kc, vc, return_lse=1)


def test_a_plan_refuses_what_attention_with_kvcache_refuses(rng):
    (q, kc, vc, k, v), = layers(rng, 1, 2, 1, 4, 2, 4, 3, 8, new=3)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] \+ Lq_new = 6 \+ 3 is beyond"):
        kvcache_plan(q, kc, vc, np.array([6, 0]), k=k, v=v)
    with pytest.raises(NotImplementedError, match="does not take a block_mask"):
        kvcache_plan(q, kc, vc, 3, block_mask=object())
    with pytest.raises(TypeError, match="q must be an array"):
        kvcache_plan(None, kc, vc, 3)


def test_a_run_takes_other_host_arrays(rng):
    torch = pytest.importorskip("torch")
    (q, kc, vc, _, _), = layers(rng, 1, 2, 1, 4, 2, 4, 4, 10)
    plan = kvcache_plan(q, kc, vc, 7)
    res = plan.run(torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc))
    assert isinstance(res, torch.Tensor)
    np.testing.assert_array_equal(res.numpy(), plan.run(q, kc, vc))
