"""The public function against the float64 reference: shapes, masks, dtypes, layouts."""

import numpy as np
import pytest

from hypothesis import example, given, settings
from hypothesis import strategies as st

from checks import TOL, check, randn, rel_err
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.reference import attention

DTYPES = [np.float32, np.float64, np.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", [(1, 1), (3, 5), (17, 65), (65, 17), (127, 300), (300, 127)])
@pytest.mark.parametrize("causal", [False, True])
def test_sizes_dtypes_causal(rng, dtype, L, S, causal):
    B, H, E, Ev = 2, 3, 17, 9
    check(randn(rng, (B, H, L, E), dtype), randn(rng, (B, H, S, E), dtype),
          randn(rng, (B, H, S, Ev), dtype), is_causal=causal)


@pytest.mark.parametrize("E,Ev", [(1, 1), (64, 64), (65, 3), (3, 130), (128, 128)])
def test_head_dims(rng, E, Ev):
    check(randn(rng, (1, 2, 70, E)), randn(rng, (1, 2, 67, E)), randn(rng, (1, 2, 67, Ev)))


@pytest.mark.parametrize("shape", [(17, 8), (3, 17, 8), (2, 3, 17, 8), (2, 1, 3, 17, 8)])
def test_ranks(rng, shape):
    q = randn(rng, shape)
    out, _ = check(q, randn(rng, shape[:-2] + (23, 8)), randn(rng, shape[:-2] + (23, 5)))
    assert out.shape == shape[:-1] + (5,)


def test_batch_dims_broadcast(rng):
    q = randn(rng, (2, 1, 3, 17, 8))
    k = randn(rng, (1, 4, 3, 23, 8))
    v = randn(rng, (4, 3, 23, 8))
    out, lse = check(q, k, v)
    assert out.shape == (2, 4, 3, 17, 8) and lse.shape == (2, 4, 3, 17)


def test_heads_broadcast_without_gqa(rng):
    # Without enable_gqa the head dim broadcasts like a batch dim (torch's math backend).
    check(randn(rng, (2, 4, 17, 8)), randn(rng, (2, 1, 23, 8)), randn(rng, (2, 1, 23, 8)))


@pytest.mark.parametrize("hq,h", [(4, 2), (6, 3), (8, 1), (3, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(rng, hq, h, causal):
    check(randn(rng, (2, hq, 33, 16)), randn(rng, (2, h, 70, 16)), randn(rng, (2, h, 70, 12)),
          enable_gqa=True, is_causal=causal)


MASK_SHAPES = [(2, 3, 37, 70), (37, 70), (70,), (1, 70), (3, 1, 70), (2, 1, 37, 1), (37, 1)]


@pytest.mark.parametrize("mshape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
def test_masks_broadcast(rng, mshape, kind, causal):
    if kind == "bool":
        mask = rng.random(mshape) < 0.7
    else:
        mask = randn(rng, mshape) * 3
        mask[rng.random(mshape) < 0.2] = -np.inf
    check(randn(rng, (2, 3, 37, 16)), randn(rng, (2, 3, 70, 16)), randn(rng, (2, 3, 70, 16)),
          attn_mask=mask, is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_mask_dtypes(rng, dtype):
    mask = (randn(rng, (17, 65)) * 2).astype(dtype)
    check(randn(rng, (1, 2, 17, 8), dtype), randn(rng, (1, 2, 65, 8), dtype),
          randn(rng, (1, 2, 65, 8), dtype), attn_mask=mask)


def test_mask_is_not_materialized(rng):
    # A broadcast view (zero strides) is read in place.
    mask = np.broadcast_to(rng.random((1, 1, 1, 300)) < 0.5, (2, 3, 129, 300))
    check(randn(rng, (2, 3, 129, 8)), randn(rng, (2, 3, 300, 8)), randn(rng, (2, 3, 300, 8)),
          attn_mask=mask)


@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_give_zeros(rng, causal):
    mask = rng.random((2, 40, 70)) < 0.5
    mask[:, [0, 5, 39]] = False
    out, lse = check(randn(rng, (2, 40, 8)), randn(rng, (2, 70, 8)), randn(rng, (2, 70, 8)),
                     attn_mask=mask, is_causal=causal)
    assert (out[:, [0, 5, 39]] == 0).all() and np.isneginf(lse[:, [0, 5, 39]]).all()
    add = np.where(mask, 0.0, -np.inf).astype(np.float32)
    out2, _ = check(randn(rng, (2, 40, 8)), randn(rng, (2, 70, 8)), randn(rng, (2, 70, 8)),
                    attn_mask=add)
    assert (out2[:, [0, 5, 39]] == 0).all()


@pytest.mark.parametrize("L", [0, 5])
def test_empty_keys_and_queries(rng, L):
    out, lse = check(randn(rng, (2, L, 8)), randn(rng, (2, 0, 8)), randn(rng, (2, 0, 4)))
    assert out.shape == (2, L, 4) and (out == 0).all() and np.isneginf(lse).all()
    out, _ = sdpa(randn(rng, (2, 0, 8)), randn(rng, (2, 7, 8)), randn(rng, (2, 7, 4)),
                  return_lse=True)
    assert out.shape == (2, 0, 4)


def test_zero_head_dims(rng):
    check(randn(rng, (2, 5, 0)), randn(rng, (2, 7, 0)), randn(rng, (2, 7, 3)))
    out = sdpa(randn(rng, (2, 5, 4)), randn(rng, (2, 7, 4)), randn(rng, (2, 7, 0)))
    assert out.shape == (2, 5, 0)


@pytest.mark.parametrize("scale", [0.0, 1e-3, 0.37, 3.0, -2.0])
def test_scale(rng, scale):
    check(randn(rng, (2, 33, 16)), randn(rng, (2, 65, 16)), randn(rng, (2, 65, 16)), scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(rng, dtype):
    # A (B, L, H, D) tensor seen as (B, H, L, D), a reversed view, and a column slice.
    x = randn(rng, (2, 130, 4, 24), dtype)
    q = x.transpose(0, 2, 1, 3)
    k = randn(rng, (2, 70, 4, 48), dtype).transpose(0, 2, 1, 3)[..., ::2]
    v = randn(rng, (2, 4, 70, 10), dtype)[:, ::-1]
    check(q, k, v, is_causal=True)
    out = np.full((2, 130, 4, 10), np.nan, dtype).transpose(0, 2, 1, 3)
    want = sdpa(q, k, v, is_causal=True)
    assert sdpa(q, k, v, out=out, is_causal=True) is out
    np.testing.assert_array_equal(out, want)  # a strided out= gets the very same values


def _lined_view(rng, shape, row, dtype, shift):
    """Random (B, H, S, D) values as a view whose rows are ``row`` elements apart and start
    64-byte cache lines, ``shift`` elements off."""
    itemsize = np.dtype(dtype).itemsize
    n = int(np.prod(shape[:-1])) * row + shift + 64
    buf = np.empty(n, dtype)
    start = (-buf.ctypes.data) % 64 // itemsize + shift
    view = buf[start:start + int(np.prod(shape[:-1])) * row].reshape(*shape[:-1], row)
    view[...] = randn(rng, view.shape, dtype)
    return view[..., :shape[-1]]


def _packed_copy(a):
    """A copy of ``a`` whose rows are not contiguous (column stride 2): always packed."""
    buf = np.empty(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    buf[..., ::2] = a
    return buf[..., ::2]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_len, ev", [(200, 128), (192, 127)])
def test_blocks_read_in_place(rng, dtype, causal, s_len, ev):
    # Full 64-key blocks of K, and of V when its rows are not a multiple of 512 bytes apart
    # (here 144 elements), are read in place at any alignment instead of packed (the tail
    # block always is; with Ev not a multiple of 4 the last block too, since the tiles read
    # Ev rounded up to a multiple of 4 columns). Same arithmetic either way: the results must
    # be bitwise those of copies with non-contiguous rows, which are packed.
    q = randn(rng, (2, 3, 150, 64), dtype)
    k = _lined_view(rng, (2, 3, s_len, 64), 80, dtype, 0)
    for shift in (0, 1):
        v = _lined_view(rng, (2, 3, s_len, ev), 144, dtype, shift)
        out, lse = check(q, k, v, is_causal=causal)
        out_c, lse_c = sdpa(q, _packed_copy(k), _packed_copy(v), is_causal=causal,
                            return_lse=True)
        np.testing.assert_array_equal(out, out_c)
        np.testing.assert_array_equal(lse, lse_c)


def test_strided_input_is_not_copied(rng):
    import tracemalloc

    import numba

    x = randn(rng, (1, 2048, 8, 64))
    q = x.transpose(0, 2, 1, 3)
    out = np.empty((1, 8, 2048, 64), np.float32)
    sdpa(q, q, q, out=out)  # compile outside the measurement
    # One thread: each thread holds one task's scratch (packed queries and the accumulator of
    # up to CHUNK rows, ~0.3 MB here), so the bound would otherwise grow with the core count.
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        tracemalloc.start()
        sdpa(q, q, q, out=out)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    finally:
        numba.set_num_threads(threads)
    # A copy of any operand would take x.nbytes.
    assert peak < x.nbytes / 4, f"peak {peak} bytes for a {x.nbytes}-byte input"


def test_batch_dims_that_cannot_merge(rng):
    # Broadcast batch dims whose strides no reshape can merge run one launch per index.
    q = randn(rng, (3, 2, 2, 9, 8))[:, ::-1]
    k = randn(rng, (1, 2, 2, 11, 8))
    v = randn(rng, (3, 1, 2, 11, 8))
    check(q, k, v)


def test_large_logits_are_stable(rng):
    q = randn(rng, (2, 65, 16)) * 100
    k = randn(rng, (2, 70, 16)) * 100  # scores ~1e4
    out, lse = check(q.astype(np.float64), k.astype(np.float64), randn(rng, (2, 70, 8), np.float64))
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    check(q, k, randn(rng, (2, 70, 8)), tol=1e-4)  # float32 scores of 1e4 lose digits


def test_nan_stays_in_its_row(rng):
    q = randn(rng, (2, 70, 16))
    k = randn(rng, (2, 130, 16))
    v = randn(rng, (2, 130, 16))
    q[1, 33, 5] = np.nan
    out, lse = sdpa(q, k, v, return_lse=True)
    assert np.isnan(out[1, 33]).all() and np.isnan(lse[1, 33])
    rest = np.ones(out.shape[:2], bool)
    rest[1, 33] = False
    q[1, 33] = 0
    check_out, check_lse = sdpa(q, k, v, return_lse=True)  # checked against the reference
    ref_out, ref_lse = attention(q, k, v)
    assert rel_err(check_out, ref_out) <= TOL[np.float32]
    # every other row: the values of the run without the NaN, bitwise
    np.testing.assert_array_equal(out[rest], check_out[rest])
    np.testing.assert_array_equal(lse[rest], check_lse[rest])


def test_returns_new_array_by_default(rng):
    q = randn(rng, (3, 5, 4))
    out = sdpa(q, q, q)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (3, 5, 4)
    out2, lse = sdpa(q, q, q, return_lse=True)
    np.testing.assert_array_equal(out, out2)
    assert lse.shape == (3, 5)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch(rng, causal):
    torch = pytest.importorskip("torch")
    q, k, v = (randn(rng, (2, 4, 67, 32), np.float64) for _ in range(3))
    mask = rng.random((67, 67)) < 0.8
    mask[:, 0] = True
    ours = sdpa(q, k, v, attn_mask=mask, is_causal=False, scale=0.3)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(mask), scale=0.3)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-10, atol=1e-12)
    ours = sdpa(q, k[:, :2], v[:, :2], is_causal=causal, enable_gqa=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k[:, :2], v[:, :2])), is_causal=causal,
        enable_gqa=True)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-10, atol=1e-12)


# Boundary cases of the CPU kernel's blocking (cpu/forward.py): key blocks of BN = 64 keys,
# score sub-blocks of BM = 64 query rows, tasks of up to 512 query rows. L and S are 0, 1, 2
# and 63 (mod 64), and S = L +- 1 around them; causal with and without masks (the causal
# block skips and mask skips sit on exactly these boundaries).
BOUNDARY = [(1, 1), (2, 2), (2, 3), (3, 2), (1, 64), (64, 1), (63, 64), (64, 63), (64, 64),
            (64, 65), (65, 64), (65, 65), (66, 65), (65, 66), (66, 66), (66, 67), (127, 128),
            (128, 127), (128, 129), (129, 128), (130, 129), (129, 130), (191, 192), (193, 192)]


@pytest.mark.parametrize("L,S", BOUNDARY, ids=[f"boundary-{L}-{S}" for L, S in BOUNDARY])
def test_boundary_sizes(rng, L, S):
    q, k, v = randn(rng, (1, 2, L, 8)), randn(rng, (1, 2, S, 8)), randn(rng, (1, 2, S, 5))
    bool_mask = rng.random((L, S)) < 0.8
    add_mask = np.where(rng.random((L, S)) < 0.15, -np.inf, randn(rng, (L, S)))
    for causal in (False, True):
        check(q, k, v, is_causal=causal)
        check(q, k, v, is_causal=causal, attn_mask=bool_mask)
        check(q, k, v, is_causal=causal, attn_mask=add_mask.astype(np.float32))


CHUNKS = [(513, 512), (512, 513), (600, 599), (639, 640)]


@pytest.mark.parametrize("L,S", CHUNKS, ids=[f"boundary-chunk-{L}-{S}" for L, S in CHUNKS])
def test_boundary_task_chunks(rng, L, S):
    # 16 heads: enough tasks that queries are split into chunks of 512 rows (not halved), so
    # that a task's last rows are 1, 88 or 127 rows: a tail of more than one sub-block.
    q, k, v = randn(rng, (16, L, 4)), randn(rng, (16, S, 4)), randn(rng, (16, S, 3))
    check(q, k, v, is_causal=True)
    check(q, k, v)


@settings(max_examples=15, deadline=None)
@given(L=st.integers(1, 200), S=st.integers(1, 200), causal=st.booleans(),
       mask=st.sampled_from(["none", "bool"]), seed=st.integers(0, 2**32 - 1))
@example(L=2, S=2, causal=True, mask="none", seed=0)  # the causal mask-skip boundary
@example(L=66, S=66, causal=True, mask="none", seed=0)  # ... in a second sub-block
@example(L=65, S=64, causal=True, mask="none", seed=0)  # a causal tail past S
@example(L=64, S=65, causal=False, mask="bool", seed=0)  # a one-key tail block with a mask
@example(L=1, S=1, causal=True, mask="bool", seed=0)
def test_random_sizes(L, S, causal, mask, seed):
    rng = np.random.default_rng(seed)
    kw = dict(is_causal=causal)
    if mask == "bool":
        kw["attn_mask"] = rng.random((L, S)) < 0.8
    check(randn(rng, (2, L, 8)), randn(rng, (2, S, 8)), randn(rng, (2, S, 3)), **kw)


# torch as an independent reference for every semantic it expresses: causal (top-left, as
# torch's is_causal) with L != S, GQA with bool and float masks, float masks with -inf.
TORCH_CASES = {
    "causal_L_gt_S": ((2, 3, 130, 16), (2, 3, 67, 16), (2, 3, 67, 8),
                      dict(is_causal=True)),
    "causal_L_lt_S": ((2, 3, 67, 16), (2, 3, 130, 16), (2, 3, 130, 8),
                      dict(is_causal=True)),
    "gqa_bool_mask": ((2, 4, 65, 16), (2, 2, 66, 16), (2, 2, 66, 8),
                      dict(enable_gqa=True, mask="bool")),
    "gqa_float_mask_neg_inf": ((2, 6, 65, 16), (2, 3, 129, 16), (2, 3, 129, 8),
                               dict(enable_gqa=True, mask="float")),
    "float_mask_neg_inf_scale": ((2, 2, 63, 16), (2, 2, 64, 16), (2, 2, 64, 8),
                                 dict(mask="float", scale=0.7)),
}


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_matches_torch_cases(rng, name):
    torch = pytest.importorskip("torch")
    qs, ks, vs, kw = TORCH_CASES[name]
    kw = dict(kw)
    q, k, v = (randn(rng, s, np.float64) for s in (qs, ks, vs))
    mask = kw.pop("mask", None)
    if mask == "bool":  # per head: a GQA mask must be read at the query head
        mask = rng.random((2, qs[1], qs[2], ks[2])) < 0.7
        mask[..., 0] = True
    elif mask == "float":
        mask = randn(rng, (2, qs[1], qs[2], ks[2]), np.float64)
        mask[rng.random(mask.shape) < 0.2] = -np.inf
        mask[..., 1] = 0.0
    ours, lse = sdpa(q, k, v, attn_mask=mask, return_lse=True, **kw)
    t = [torch.from_numpy(a) for a in (q, k, v)]
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *t, attn_mask=None if mask is None else torch.from_numpy(mask), **kw).numpy()
    assert rel_err(ours, theirs) <= TOL[np.float64]
    # the lse too: torch's math reference, logsumexp of the masked scores
    scale = kw.get("scale", 1 / np.sqrt(qs[-1]))
    rep = qs[1] // ks[1]
    s = torch.matmul(t[0], t[1].repeat_interleave(rep, dim=1).transpose(-1, -2)) * scale
    if kw.get("is_causal"):
        s = s.masked_fill(~torch.ones(qs[2], ks[2], dtype=torch.bool).tril(), -torch.inf)
    if mask is not None:
        m = torch.from_numpy(mask)
        s = s.masked_fill(~m, -torch.inf) if mask.dtype == bool else s + m
    want = torch.logsumexp(s, dim=-1).numpy()
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isneginf(lse), ~fin)
    assert np.abs(lse[fin] - want[fin]).max() <= 40 * np.finfo(float).eps * max(
        1.0, np.abs(want[fin]).max())


def test_lse_of_scores_whose_terms_cancel():
    """A score is a dot product: when its terms cancel, it keeps the rounding error of the
    terms, not of its small value. The lse bound follows the terms' magnitude (found by
    hypothesis: S = 1, E = 64, scale 1.9375 gave 49 eps of |lse| on this seed)."""
    rng = np.random.default_rng(18)
    q, k, v = randn(rng, (2, 1, 130, 64)), randn(rng, (2, 1, 1, 64)), randn(rng, (2, 1, 1, 1))
    check(q, k, v, scale=1.9375)
