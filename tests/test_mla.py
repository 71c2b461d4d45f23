"""Absorbed MLA decode (DeepSeek's multi-head latent attention) through
``attention_with_kvcache``, as docs/serving.md's recipe writes it: a paged latent cache whose
value cache is a view of the key cache's first columns, the new token's latent appended once
through both, against the float64 reference of MLA written the long way (per-head keys and
values up-projected from the latent). No new compiled kernel: the float32 decode kernel with
run-time widths."""

import numpy as np

from sdpa_numba import attention_with_kvcache, reference

HQ, LATENT, ROPE, NOPE, VDIM = 4, 32, 8, 16, 16


def test_absorbed_mla_decode_over_a_paged_latent_cache(rng):
    ps, lens = 16, np.array([20, 33, 0])
    w_uk = rng.standard_normal((HQ, NOPE, LATENT)) / np.sqrt(LATENT)  # latent -> key (nope)
    w_uv = rng.standard_normal((HQ, VDIM, LATENT)) / np.sqrt(LATENT)  # latent -> value
    table = np.array([[3, 0, 5], [1, 4, 2], [6, 7, 8]], np.int32)
    # The cache rows: [latent c_kv | shared rotary key k_pe], one "head".
    cache = rng.standard_normal((9, ps, 1, LATENT + ROPE)).astype(np.float32)
    q_nope = rng.standard_normal((3, HQ, NOPE))
    q_pe = rng.standard_normal((3, HQ, ROPE))
    new = rng.standard_normal((3, 1, 1, LATENT + ROPE)).astype(np.float32)  # this step's row
    scale = 1 / np.sqrt(NOPE + ROPE)  # the model's: the head dim before absorption

    # Absorbed: W_UK folded into the query, so queries meet the latent rows directly.
    q_abs = np.concatenate([np.einsum("bhn,hnc->bhc", q_nope, w_uk), q_pe], -1)
    k_cache = cache.copy()
    out = attention_with_kvcache(q_abs[:, None].astype(np.float32), k_cache,
                                 k_cache[..., :LATENT], lens, k=new, v=new[..., :LATENT],
                                 block_table=table, scale=scale)
    got = np.einsum("bhc,hvc->bhv", out[:, 0].astype(np.float64), w_uv)

    for b in range(3):
        n = lens[b] + 1
        j = np.arange(n)
        rows = k_cache[table[b, j // ps], j % ps, 0].astype(np.float64)  # (n, LATENT + ROPE)
        assert np.array_equal(rows[-1], new[b, 0, 0])  # appended once, through both views
        c_kv, k_pe = rows[:, :LATENT], rows[:, LATENT:]
        # The long way: per-head keys [W_UK c_kv | k_pe] and values W_UV c_kv.
        k = np.concatenate([np.einsum("hnc,sc->hsn", w_uk, c_kv),
                            np.broadcast_to(k_pe, (HQ, n, ROPE))], -1)
        v = np.einsum("hvc,sc->hsv", w_uv, c_kv)
        q = np.concatenate([q_nope[b], q_pe[b]], -1)[:, None]
        want = reference.attention(q, k, v, scale=scale)[0][:, 0]
        np.testing.assert_allclose(got[b], want, rtol=2e-5, atol=2e-5)
