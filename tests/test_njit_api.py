"""The Numba-level API, called from a user's own jitted code."""

import importlib

import numpy as np
import pytest
from numba import njit, prange

from checks import TOL, randn, rel_err
from sdpa_numba import cpu, scaled_dot_product_attention as sdpa
from sdpa_numba.reference import attention

# The module (its name is shadowed in sdpa_numba.cpu by the kernel it defines).
forward_module = importlib.import_module("sdpa_numba.cpu.forward")


def test_batched_forward_from_user_njit(rng):
    # float64: the forward specialization test_batched_backward_from_user_njit compiles too
    # (float32 from a user's function: test_serial_head_forward_inside_user_prange).
    @njit
    def user(q, k, v, scale):
        out = np.empty(q.shape[:3] + (v.shape[3],), q.dtype)
        lse = np.empty(q.shape[:3], q.dtype)
        cpu.forward(q, k, v, None, True, scale, out, lse)
        return out, lse

    q = randn(rng, (2, 4, 70, 16), np.float64)
    k, v = randn(rng, (2, 2, 90, 16), np.float64), randn(rng, (2, 2, 90, 8), np.float64)
    out, lse = user(q, k, v, 0.25)
    ref, ref_lse = attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    assert rel_err(out, ref) < TOL[np.float64]
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


def test_batched_forward_with_mask_from_user_njit(rng):
    @njit
    def user(q, k, v, mask, out, lse):
        cpu.forward(q, k, v, mask, False, 1.0 / np.sqrt(q.shape[3]), out, lse)

    q, k, v = (randn(rng, (1, 2, 33, 8), np.float64) for _ in range(3))
    mask = rng.random((1, 2, 33, 33)) < 0.7
    out = np.full((1, 2, 33, 8), np.nan)
    lse = np.full((1, 2, 33), np.nan)
    user(q, k, v, mask, out, lse)
    ref, _ = attention(q, k, v, attn_mask=mask)
    assert rel_err(out, ref) < TOL[np.float64]


def test_serial_head_forward_inside_user_prange(rng):
    @njit(parallel=True)
    def user(q, k, v, out, lse):
        for h in prange(q.shape[0]):
            cpu.forward_head(q[h], k[h], v[h], None, False, 0.5, out[h], lse[h])

    q, k, v = randn(rng, (5, 130, 16)), randn(rng, (5, 67, 16)), randn(rng, (5, 67, 16))
    out = np.full((5, 130, 16), np.nan, np.float32)
    lse = np.full((5, 130), np.nan, np.float32)
    user(q, k, v, out, lse)
    ref, ref_lse = attention(q, k, v, scale=0.5)
    assert rel_err(out, ref) < TOL[np.float32]
    # Same rows as the batched kernel, bit for bit.
    assert out.tobytes() == sdpa(q, k, v, scale=0.5).tobytes()


@pytest.mark.parametrize("causal", [False, True])
def test_rows_do_not_depend_on_their_chunk(rng, causal):
    # forward_head gives a task CHUNK rows; the batched kernel gives these 2 heads 64-row
    # chunks (it halves chunks until there are MIN_TASKS tasks). Rows past CHUNK, and causal
    # rows cut differently, must come out bit for bit the same either way.
    q, k, v = randn(rng, (2, 700, 16)), randn(rng, (2, 650, 16)), randn(rng, (2, 650, 16))
    serial_rows = forward_module._task_rows(16, 16, 4)
    assert serial_rows == forward_module.CHUNK < q.shape[1]
    assert forward_module._chunk_rows(2, 700, 16, 16, 4) == forward_module.BM
    out = np.full((2, 700, 16), np.nan, np.float32)
    lse = np.full((2, 700), np.nan, np.float32)
    for h in range(2):
        cpu.forward_head(q[h], k[h], v[h], None, causal, 0.25, out[h], lse[h])
    want, want_lse = sdpa(q, k, v, is_causal=causal, scale=0.25, return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


def test_task_rows_keep_the_scratch_in_bounds():
    # Packed queries and accumulator (the value dim rounded up to a multiple of 4 rows) of
    # one task stay within SCRATCH_BYTES, with CHUNK rows where that allows, never under BM.
    f = forward_module
    for e, ev, itemsize in [(64, 64, 4), (128, 128, 4), (128, 128, 8), (100, 80, 4),
                            (256, 256, 4), (4096, 4096, 8), (1, 1, 4)]:
        rows = f._task_rows(e, ev, itemsize)
        scratch = rows * (e + -(-ev // 4) * 4) * itemsize
        assert f.BM <= rows <= f.CHUNK
        assert scratch <= f.SCRATCH_BYTES or rows == f.BM
        assert rows == f.CHUNK or 2 * scratch > f.SCRATCH_BYTES
    assert f._task_rows(128, 128, 4) == f.CHUNK  # the headline shapes keep 512 rows
    assert f._task_rows(128, 128, 8) == f.CHUNK // 2


def test_online_softmax_block_update_from_user_njit(rng):
    @njit
    def user(s, v, block):
        n, ev = s.shape[0], v.shape[1]
        m = np.full(n, -np.inf)
        l = np.zeros(n)
        acc = np.zeros((n, ev))
        for j0 in range(0, s.shape[1], block):
            cpu.online_softmax_update(s[:, j0:j0 + block], v[j0:j0 + block], m, l, acc)
        out = np.empty((n, ev))
        lse = np.empty(n)
        cpu.online_softmax_finalize(m, l, acc, out, lse)
        return out, lse

    s = randn(rng, (9, 50), np.float64) * 5
    s[3] = -np.inf  # a fully masked row
    s[4, :30] = -np.inf  # masked in the first blocks only
    v = randn(rng, (50, 6), np.float64)
    out, lse = user(s, v, 7)
    p = np.exp(s - np.where(np.isneginf(s.max(1)), 0, s.max(1))[:, None])
    l = p.sum(1, keepdims=True)
    ref = np.where(l > 0, p / np.where(l > 0, l, 1), 0) @ v
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    assert (out[3] == 0).all() and np.isneginf(lse[3])
    np.testing.assert_allclose(np.delete(lse, 3), np.log(np.delete(l[:, 0], 3))
                               + np.delete(s.max(1), 3), rtol=1e-12)


def test_float16_through_uint16_views_from_user_njit(rng):
    @njit
    def user(q, k, v, out, lse):
        cpu.forward(q, k, v, None, False, 0.25, out, lse)

    q, k, v = (randn(rng, (1, 1, 40, 16), np.float16) for _ in range(3))
    out = np.empty((1, 1, 40, 16), np.float16)
    user(q.view(np.uint16), k.view(np.uint16), v.view(np.uint16), out.view(np.uint16),
         np.empty((1, 1, 40), np.float32))
    ref, _ = attention(q, k, v, scale=0.25)
    assert rel_err(out, ref) < TOL[np.float16]


def test_batched_backward_from_user_njit(rng):
    """A training step written in Numba: the forward, then the backward, from a user's @njit."""
    from sdpa_numba.reference import attention_backward

    @njit
    def user(q, k, v, dout, scale):
        out = np.empty(q.shape[:3] + (v.shape[3],), q.dtype)
        lse = np.empty(q.shape[:3], q.dtype)
        cpu.forward(q, k, v, None, True, scale, out, lse)
        dq = np.full(q.shape, np.nan, q.dtype)
        dk = np.full(k.shape, np.nan, k.dtype)
        dv = np.full(v.shape, np.nan, v.dtype)
        cpu.backward(q, k, v, None, True, scale, dout, out, lse, dq, dk, dv)
        return dq, dk, dv

    # GQA (4 query heads on 2 key/value heads), causal with L > S, Ev != E, odd sizes.
    q = randn(rng, (2, 4, 37, 16), np.float64)
    k, v = randn(rng, (2, 2, 29, 16), np.float64), randn(rng, (2, 2, 29, 8), np.float64)
    dout = randn(rng, (2, 4, 37, 8), np.float64)
    got = user(q, k, v, dout, 0.3)
    want = attention_backward(dout, q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    for g, w in zip(got, want[:3]):
        assert rel_err(g, w) < 1e-10


@njit
def _rel_bias(s, b, h, i, j, table):
    """A user's score_mod: a relative-position bias per query head (T5-like)."""
    return s + table[h, i - j + table.shape[1] // 2]


def test_variants_forward_from_user_njit(rng):
    """A user's @njit builds a recipe (bottom-right window, soft cap, a score_mod with its
    table) and runs the batched kernel and the serial one per head with it."""
    from sdpa_numba.score.recipe import recipe

    @njit
    def user(q, k, v, table, out, lse, out_h, lse_h):
        r = recipe(offset=k.shape[2] - q.shape[2], left=23, right=2, softcap=4.0,
                   score_mod=_rel_bias, mod_args=(table,))
        cpu.forward(q, k, v, None, False, 0.3, out, lse, None, r)
        group = q.shape[1] // k.shape[1]
        for b in range(q.shape[0]):
            for h in range(q.shape[1]):
                cpu.forward_head(q[b, h], k[b, h // group], v[b, h // group], None, False, 0.3,
                                 out_h[b, h], lse_h[b, h], r, b, h)

    q = randn(rng, (2, 4, 70, 16))
    k, v = randn(rng, (2, 2, 97, 16)), randn(rng, (2, 2, 97, 8))
    table = randn(rng, (4, 2 * 97 + 1))
    out, out_h = (np.full((2, 4, 70, 8), np.nan, np.float32) for _ in range(2))
    lse, lse_h = (np.full((2, 4, 70), np.nan, np.float32) for _ in range(2))
    user(q, k, v, table, out, lse, out_h, lse_h)
    ref, ref_lse = attention(q, k, v, scale=0.3, enable_gqa=True, window=(23, 2),
                             alignment="bottom_right", softcap=4.0, score_mod=_rel_bias,
                             mod_args=(table,))
    assert rel_err(out, ref) < TOL[np.float32]
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    # the serial kernel gives the batched one's rows, bit for bit
    np.testing.assert_array_equal(out_h, out)
    np.testing.assert_array_equal(lse_h, lse)


def test_constants_and_variables_share_one_specialization(rng):
    # A user's function passing is_causal as the constant True, the constant False or a
    # variable (and leaving the optional arguments out or passing None) compiles the kernel
    # once: Numba would type each constant as its literal, a specialization of its own.
    @njit
    def user(q, k, v, out, lse, causal):
        cpu.forward_head(q, k, v, None, True, 0.5, out, lse)
        a = out.copy()
        cpu.forward_head(q, k, v, None, False, 0.5, out, lse, None)
        b = out.copy()
        cpu.forward_head(q, k, v, None, causal, 0.5, out, lse)
        return a, b

    q, k, v = randn(rng, (37, 16)), randn(rng, (45, 16)), randn(rng, (45, 16))
    out = np.full((37, 16), np.nan, np.float32)
    lse = np.full(37, np.nan, np.float32)
    before = len(cpu.forward_head.overloads)
    a, b = user(q, k, v, out, lse, True)
    assert len(cpu.forward_head.overloads) <= before + 1
    for got, causal in ((a, True), (b, False), (out, True)):
        ref, _ = attention(q, k, v, is_causal=causal, scale=0.5)
        assert rel_err(got, ref) < TOL[np.float32]
    assert not np.array_equal(a, b)
