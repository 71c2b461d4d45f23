"""Serving: a decode loop over a paged key/value cache, and attention split over key ranges
merged by lse. Each result is checked against the float64 reference."""

import numpy as np

import sdpa_numba
from sdpa_numba.reference import attention

rng = np.random.default_rng(0)
B, Hq, H, E = 2, 8, 2, 64  # two sequences, GQA: 4 query heads per key/value head
page_size, num_pages = 16, 64

# --- A decode loop with a paged cache ------------------------------------------------------
k_cache = np.zeros((num_pages, page_size, H, E), np.float32)
v_cache = np.zeros((num_pages, page_size, H, E), np.float32)
block_table = rng.permutation(num_pages).reshape(B, -1).astype(np.int32)  # pages of each sequence
cache_seqlens = np.zeros(B, np.int32)

# Prefill: the prompts (37 and 20 tokens) in one call each, padded to one length; the cache
# positions past a prompt's end are written too but never read before being overwritten.
prompt_len = np.array([37, 20])
prompt = rng.standard_normal((B, 37, Hq, E), dtype=np.float32)
k_new = rng.standard_normal((B, 37, H, E), dtype=np.float32)
v_new = rng.standard_normal((B, 37, H, E), dtype=np.float32)
out = sdpa_numba.attention_with_kvcache(prompt, k_cache, v_cache, cache_seqlens, k=k_new,
                                        v=v_new, block_table=block_table)  # causal by default
cache_seqlens += prompt_len  # the caller keeps the lengths: sequence 1 continues at 20

keys = [list(k_new[b, :n]) for b, n in enumerate(prompt_len)]  # for the check below
values = [list(v_new[b, :n]) for b, n in enumerate(prompt_len)]
for step in range(5):  # one new token per sequence per step
    q = rng.standard_normal((B, 1, Hq, E), dtype=np.float32)
    k1 = rng.standard_normal((B, 1, H, E), dtype=np.float32)
    v1 = rng.standard_normal((B, 1, H, E), dtype=np.float32)
    out = sdpa_numba.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k1, v=v1,
                                            block_table=block_table)  # (B, 1, Hq, E)
    cache_seqlens += 1
    for b in range(B):
        keys[b].append(k1[b, 0])
        values[b].append(v1[b, 0])
        ref, _ = attention(q[b].transpose(1, 0, 2), np.transpose(keys[b], (1, 0, 2)),
                           np.transpose(values[b], (1, 0, 2)), enable_gqa=True)
        assert np.allclose(out[b], ref.transpose(1, 0, 2), atol=1e-5)

# --- A left-padded batch with a sliding window ----------------------------------------------
# Prompts of 50 and 30 tokens, left-padded to one length: sequence 1's first 20 slots are
# padding. cache_leftpad says where each cache starts; positions stay the cache's. A window of
# the 40 keys before each token: this step reads keys 10 .. 50 of sequence 0 and 20 .. 50 of
# sequence 1, whatever the cache's length.
S = 64
k_cache = rng.standard_normal((B, S, H, E), dtype=np.float32)
v_cache = rng.standard_normal((B, S, H, E), dtype=np.float32)
cache_seqlens = np.array([50, 50], np.int32)
cache_leftpad = np.array([0, 20], np.int32)
q = rng.standard_normal((B, 1, Hq, E), dtype=np.float32)
k1 = rng.standard_normal((B, 1, H, E), dtype=np.float32)
v1 = rng.standard_normal((B, 1, H, E), dtype=np.float32)
out = sdpa_numba.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k1, v=v1,
                                        cache_leftpad=cache_leftpad, window=(40, 0))
for b in range(B):  # the new token sits at position 50
    j0 = max(50 - 40, cache_leftpad[b])
    ref, _ = attention(q[b].transpose(1, 0, 2), k_cache[b, j0:51].transpose(1, 0, 2),
                       v_cache[b, j0:51].transpose(1, 0, 2), enable_gqa=True)
    assert np.allclose(out[b], ref.transpose(1, 0, 2), atol=1e-5)

# --- A split over key ranges, merged by lse ------------------------------------------------
# Attention over disjoint key sets (two devices' shards, two chunks of a long cache) combines
# exactly: each part's output weighted by exp(lse_part - lse).
q = rng.standard_normal((1, Hq, 3, E))
k = rng.standard_normal((1, H, 1000, E))
v = rng.standard_normal((1, H, 1000, E))
part_a = sdpa_numba.scaled_dot_product_attention(q, k[:, :, :600], v[:, :, :600],
                                                 enable_gqa=True, return_lse=True)
part_b = sdpa_numba.scaled_dot_product_attention(q, k[:, :, 600:], v[:, :, 600:],
                                                 enable_gqa=True, return_lse=True)
out, lse = sdpa_numba.merge_attention_states(*part_a, *part_b)
ref, ref_lse = attention(q, k, v, enable_gqa=True)
assert np.allclose(out, ref, atol=1e-12) and np.allclose(lse, ref_lse, atol=1e-12)

print("serving: the decode loop, the windowed left-padded batch and the merged split match "
      "the float64 reference")
