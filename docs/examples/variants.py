"""Attention variants: one worked example of each, checked against the float64 reference.

Run: python docs/examples/variants.py   (the tests run it too)
"""

import numpy as np
from numba import njit

import sdpa_numba
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.reference import attention  # plain NumPy, float64: the yardstick


def close(kw, **ref_kw):
    """sdpa_numba with the keywords ``kw`` against the reference (with ``ref_kw`` added)."""
    out = sdpa(q, k, v, **kw)
    ref = {name: x for name, x in {**kw, **ref_kw}.items() if name != "block_mask"}
    want, _ = attention(q, k, v, **ref)
    err = np.linalg.norm(out - want) / np.linalg.norm(want)
    assert err < 1e-5, (kw, err)
    return out


rng = np.random.default_rng(0)
B, H, L, S, E = 2, 4, 100, 160, 32
q = rng.standard_normal((B, H, L, E), dtype=np.float32)
k = rng.standard_normal((B, H, S, E), dtype=np.float32)
v = rng.standard_normal((B, H, S, E), dtype=np.float32)

# 1. A sliding window (Mistral, Gemma): row i sees keys i - 64 .. i (causal: right side 0).
close(dict(window=(64, 0), is_causal=True))

# 2. Bottom-right alignment (KV cache, chunked prefill): the last query sees the last key,
#    query i sits at key i + S - L. Applies to is_causal, window and ALiBi.
close(dict(is_causal=True, alignment="bottom_right"))

# 3. Soft-capped scores (Gemma 2: 50.0 on the attention logits): s <- c * tanh(s / c).
close(dict(softcap=50.0))

# 4. ALiBi (BLOOM, MPT): adds -slope_h * |i' - j|, one slope per head (or per batch entry).
slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
close(dict(alibi_slopes=slopes.astype(np.float32), is_causal=True))

# 5. Attention sinks (gpt-oss): one logit per head joins every row's softmax denominator.
#    lse includes it; a row that sees no key gets 0 and lse = its head's sink.
sinks = np.array([0.0, 1.0, -1.0, 2.0], np.float32)
close(dict(sinks=sinks))
q_long = rng.standard_normal((B, H, S + 20, E), dtype=np.float32)  # 20 rows more than keys
out, lse = sdpa(q_long, k, v, sinks=sinks, is_causal=True, alignment="bottom_right",
                return_lse=True)
assert np.all(out[:, :, :20] == 0) and np.all(lse[:, :, :20] == sinks[:, None])


# 6. Your own score function, compiled into the kernel: a relative-position bias table
#    (T5-like) through mod_args. Changing the table's contents never recompiles.
@njit
def rel_bias(score, b, h, i, j, table):
    return score + table[h, i - j + S]


table = rng.standard_normal((H, L + S + 1)).astype(np.float32)
close(dict(score_mod=rel_bias, mod_args=(table,)))


# ... and its derivative in the score, which the backward needs.
@njit
def rel_bias_grad(score, b, h, i, j, table):
    return 1.0


# 7. Your own mask: document masking (a query sees the keys of its own document) with
#    prefix-LM (the first `prefix` keys are seen by every query of the document, the rest
#    causally). A block mask, made once, skips the blocks no key takes part in and the
#    per-element test in the blocks every key does.
@njit
def documents(b, h, i, j, doc_q, doc_k, prefix):
    return doc_q[b, i] == doc_k[b, j] and (j < prefix or j <= i)


doc_q = np.sort(rng.integers(0, 3, (B, L)), axis=1)
doc_k = np.sort(rng.integers(0, 3, (B, S)), axis=1)
args = (doc_q, doc_k, 16)
block_mask = sdpa_numba.create_block_mask(documents, B, None, L, S, mod_args=args)
assert block_mask.sparsity() > 0.3  # a third of the blocks or more are skipped
close(dict(block_mask=block_mask, mod_args=args), mask_mod=documents)

# 8. Combined: every variant composes (the order of the score: scale, soft cap, ALiBi,
#    score_mod, a float attn_mask added; then window, bool mask and mask_mod mask it).
close(dict(window=(64, 8), softcap=30.0, sinks=sinks, alibi_slopes=slopes.astype(np.float32),
           alignment="bottom_right", attn_mask=rng.random((L, S)) > 0.1))

print("variants: all results match the float64 reference")
