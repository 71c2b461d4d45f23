"""The forward's partial blocks of query rows: only the lanes of real rows are computed.

A block of BM = 64 query rows with ``n < 64`` real ones computes ``ceil(n / 16) * 16`` lanes
(``sdpa_numba.cpu.microkernel.LANE_CHUNK``) in its score tiles. The lanes past them hold
whatever the last tile left (or zeros): a lane counted wrong would show as a wrong or
unwritten (NaN-poisoned) row here, against the float64 reference, at row counts on either
side of the chunk edges. The register passes' narrowed form is also checked on its own:
the columns it computes are bitwise those of the whole tile (``register_passes``' docstring's
promise), and it touches no other column. (Compiled with the kernels' fast-math flags: the inlined passes take
their caller's, and without ``contract`` the whole tile's sums are not fused multiply-adds.)
"""

import numpy as np
import pytest
from numba import njit, types

from checks import check, randn
from sdpa_numba.cpu._llvm import data_ptr, prefer_512_bit
from sdpa_numba.cpu.microkernel import LANE_CHUNK, MR_WIDE, NR, register_passes
from sdpa_numba.cpu.options import CALLED

ROWS = [1, 15, 16, 17, 33, 48, 63, 65, 129]


@pytest.mark.parametrize("L", ROWS)
@pytest.mark.parametrize("variant", ["dense", "causal", "bool_mask", "float_mask", "window",
                                     "softcap"])
def test_partial_blocks_match_reference(rng, L, variant):
    S, E, Ev = 150, 40, 24
    q, k, v = randn(rng, (1, 2, L, E)), randn(rng, (1, 2, S, E)), randn(rng, (1, 2, S, Ev))
    kw = {}
    if variant == "causal":
        kw = dict(is_causal=True)
    elif variant == "bool_mask":
        mask = rng.random((L, S)) > 0.4
        mask[0] = False  # a fully masked row: zeros and lse -inf
        kw = dict(attn_mask=mask)
    elif variant == "float_mask":
        kw = dict(attn_mask=randn(rng, (L, S)))
    elif variant == "window":
        # bottom-right aligned: a band that moves with the row, so lanes differ per key
        kw = dict(is_causal=True, window=(37, 0), alignment="bottom_right")
    elif variant == "softcap":
        kw = dict(softcap=4.0)
    check(q, k, v, **kw)


@pytest.mark.parametrize("L", [1, 17, 65])
def test_partial_blocks_float64(rng, L):
    S, E, Ev = 90, 33, 20
    check(randn(rng, (2, 1, L, E), np.float64), randn(rng, (2, 1, S, E), np.float64),
          randn(rng, (2, 1, S, Ev), np.float64), is_causal=True)


def _tile(dtype, kind):
    """``(a, b, c, alpha, lanes)``: the passes the forward's scores use (``set``: c = a b,
    narrowable), or the same with one alpha per row (``row``), from a user's ``@njit``."""
    passes = register_passes(types.float32 if dtype == np.float32 else types.float64, False,
                             kind == "row", False)

    if kind == "set":
        @njit(**CALLED)  # the kernels' flags: the inlined passes take the caller's
        def run(a, b, c, alpha, lanes):
            prefer_512_bit()
            passes(data_ptr(a), a.shape[1], 1, data_ptr(b), NR, data_ptr(c), NR, a.shape[1],
                   None, MR_WIDE, lanes)
    else:
        @njit(**CALLED)
        def run(a, b, c, alpha, lanes):
            prefer_512_bit()
            passes(data_ptr(a), a.shape[1], 1, data_ptr(b), NR, data_ptr(c), NR, a.shape[1],
                   data_ptr(alpha), MR_WIDE, lanes)
    return run


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["set", "row"])
def test_narrowed_tile_is_bitwise_the_whole_tiles(rng, dtype, kind):
    K = 77  # a run-time k_len, as the forward's scores (E)
    a = randn(rng, (MR_WIDE, K), dtype) * 3
    b = randn(rng, (K, NR), dtype)
    c0 = randn(rng, (MR_WIDE, NR), dtype)
    alpha = rng.random(MR_WIDE).astype(dtype)

    tile = _tile(dtype, kind)

    def run(c, lanes):
        tile(a, b, c, alpha, lanes)

    whole = c0.copy()
    run(whole, NR)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    if kind == "row":
        ref += alpha[:, None] * c0
    assert np.abs(whole - ref).max() <= 1e-4 * np.abs(ref).max()
    for lanes in range(LANE_CHUNK, NR, LANE_CHUNK):
        c = c0.copy()
        c[:, lanes:] = np.nan  # never read, never written
        run(c, lanes)
        assert c[:, :lanes].tobytes() == whole[:, :lanes].tobytes(), lanes
        assert np.isnan(c[:, lanes:]).all(), lanes
