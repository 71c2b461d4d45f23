"""The online softmax step in your own @njit code: attention over keys that arrive in chunks.

cpu.online_softmax_update(s, v, m, l, acc) folds a block of already scaled and masked scores
s (n, b) and its values v (b, ev) into the running max m (n,), running sum l (n,) and
unnormalized output acc (n, ev); cpu.online_softmax_finalize(m, l, acc, out, lse) writes
out = acc / l and lse = m + log(l). Start with m = -inf, l = 0, acc = 0. The result does not
depend on how the keys are split (up to rounding), so the chunks can come from anywhere: a
paged KV cache, a stream, another process.

Run: python docs/examples/njit_online_softmax.py
"""

import numpy as np
from numba import njit

from sdpa_numba import cpu
from sdpa_numba.reference import attention


@njit
def chunked_attention(q, k, v, chunk, scale):
    n, e = q.shape
    m = np.full(n, -np.inf)
    l = np.zeros(n)
    acc = np.zeros((n, v.shape[1]))
    for j0 in range(0, k.shape[0], chunk):
        kc = k[j0:j0 + chunk]
        s = np.empty((n, kc.shape[0]))
        for i in range(n):  # this chunk's scores, scaled
            for j in range(kc.shape[0]):
                t = 0.0
                for d in range(e):
                    t += q[i, d] * kc[j, d]
                s[i, j] = t * scale
        cpu.online_softmax_update(s, v[j0:j0 + chunk], m, l, acc)
    out = np.empty_like(acc)
    lse = np.empty(n)
    cpu.online_softmax_finalize(m, l, acc, out, lse)
    return out, lse


rng = np.random.default_rng(3)
q = rng.standard_normal((5, 8))
k = rng.standard_normal((300, 8)) * 40  # large scores: exp(s) alone would overflow
v = rng.standard_normal((300, 4))
ref, ref_lse = attention(q, k, v, scale=1.0)
for chunk in (1, 7, 64, 300):
    out, lse = chunked_attention(q, k, v, chunk, 1.0)
    assert np.allclose(out, ref, rtol=1e-9, atol=1e-12), chunk
    assert np.allclose(lse, ref_lse, rtol=1e-12), chunk
print(f"njit_online_softmax: same result for every chunk size; largest lse {lse.max():.0f}")
