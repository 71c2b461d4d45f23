"""The attention forward on the CPU, FlashAttention-2 style.

Work is split into tasks of (batch, head, chunk of query rows); each task streams key/value
blocks of ``BN`` keys, packs them into contiguous per-task tiles (Kᵀ and V, converted to the
compute dtype), and for each sub-block of ``BM`` query rows computes the score tile with the
register-tiled :func:`tile_product`, applies masks, runs the online softmax and accumulates
P·V. Memory per task is O(chunk · (E + Ev) + BN · (E + Ev)); nothing of size L x S exists.

Each query row is reduced by one task, over key blocks in a fixed order, with arithmetic that
does not depend on the row's place in its tile: the output is bitwise the same for any thread
count.
"""

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._llvm import data_ptr, ptr_add
from .dropout import drop_row, head_dropout
from .microkernel import MR, NR, tile_product
from .online_softmax import LN2, LOG2E, softmax_row_base2
from .options import FASTMATH, INLINE, KERNEL
from .storage import cast, load, store

#: Keys per key/value block: one micro-tile wide.
BN = NR
#: Query rows per score tile.
BM = 64
#: Query rows per task when there are enough tasks to keep every core busy.
CHUNK = 256


@njit(**INLINE)
def _pack_rows(src, i0, n, n_pad, width, scale, dst):
    """dst[r, :width] = scale * src[i0 + r, :] for r < n; zero rows up to n_pad."""
    for r in range(n):
        for e in range(width):
            dst[r * width + e] = load(src[i0 + r, e]) * scale
    for t in range(n * width, n_pad * width):
        dst[t] = 0


@njit(**INLINE)
def _pack_kv(k, v, j0, nj, kt, vs, ev_pad):
    """Kᵀ block into kt (E x BN) and V block into vs (BN x ev_pad), zero-padded.

    Padding must be zeros, not garbage: masked keys get p = 0, and 0 * NaN would be NaN.
    """
    e_len = k.shape[1]
    ev = v.shape[1]
    for e in range(e_len):
        for j in range(nj):
            kt[e * BN + j] = load(k[j0 + j, e])
        for j in range(nj, BN):
            kt[e * BN + j] = 0
    for j in range(nj):
        for d in range(ev):
            vs[j * ev_pad + d] = load(v[j0 + j, d])
        for d in range(ev, ev_pad):
            vs[j * ev_pad + d] = 0
    for t in range(nj * ev_pad, BN * ev_pad):
        vs[t] = 0


def masked_score(s, x):
    """Base-2 score ``s`` under mask element ``x`` (jitted code only)."""
    raise NotImplementedError("masked_score is only callable from jitted code")


@overload(masked_score, fastmath=FASTMATH)
def _masked_score(s, x):
    if isinstance(x, types.Boolean):  # True takes part
        return lambda s, x: s if x else cast(-np.inf, s)
    return lambda s, x: s + load(x) * cast(LOG2E, s)  # additive, in natural units


@njit(**INLINE)
def _mask_tile(sb, rows, i_first, i_real_end, j0, kv_end, mask, is_causal):
    """Set masked scores of a BM x BN tile (base-2 units) to -inf or add the additive mask.

    Rows at or past ``i_real_end`` are padding: only the key bounds apply to them.
    """
    neg_inf = cast(-np.inf, sb)
    for r in range(rows):
        i = i_first + r
        row = ptr_add(data_ptr(sb), r * BN)
        j_stop = kv_end
        if is_causal:
            j_stop = min(j_stop, i + 1)
        for j in range(max(j_stop - j0, 0), BN):
            row[j] = neg_inf
        if mask is not None and i < i_real_end:
            for j in range(min(BN, kv_end - j0)):
                row[j] = masked_score(row[j], mask[i, j0 + j])


@njit(**INLINE)
def attend_rows(q, k, v, mask, is_causal, scale, out, lse, i0, i1, dropout=None):
    """Attention of query rows ``[i0, i1)`` of one head; writes ``out[i0:i1]``, ``lse[i0:i1]``.

    ``q`` (L, E), ``k`` (S, E), ``v`` (S, Ev), ``mask`` None or (L, S) (bool: True takes part;
    float: added), ``out`` (L, Ev), ``lse`` (L,) whose dtype is the compute dtype.
    ``dropout``: None, or this head's state from :func:`~sdpa_numba.cpu.dropout.head_dropout`.
    """
    s_len, e_len = k.shape
    ev = v.shape[1]
    n = i1 - i0
    n_pad = (n + MR - 1) // MR * MR
    ev_pad = (ev + NR - 1) // NR * NR
    ct = lse.dtype
    qs = np.empty(max(n_pad * e_len, 1), ct)
    kt = np.empty(max(e_len * BN, 1), ct)
    vs = np.empty(max(BN * ev_pad, 1), ct)
    sb = np.empty(BM * BN, ct)
    acc = np.zeros(max(n_pad * ev_pad, 1), ct)
    m = np.full(n_pad, -np.inf, ct)
    l = np.zeros(n_pad, ct)
    alpha = np.empty(n_pad, ct)
    # Scores are computed in base 2: exp(x) = 2**(x log2 e), folded into the packed queries.
    _pack_rows(q, i0, n, n_pad, e_len, cast(scale * LOG2E, lse), qs)
    p_qs, p_kt, p_vs, p_sb = data_ptr(qs), data_ptr(kt), data_ptr(vs), data_ptr(sb)
    p_acc, p_alpha = data_ptr(acc), data_ptr(alpha)

    kv_end = min(s_len, i1) if is_causal else s_len
    for j0 in range(0, kv_end, BN):
        nj = min(BN, kv_end - j0)
        _pack_kv(k, v, j0, nj, kt, vs, ev_pad)
        for r0 in range(0, n_pad, BM):
            rows = min(BM, n_pad - r0)
            if is_causal and j0 > i0 + r0 + rows - 1:
                continue  # the whole tile is above the diagonal
            for rt in range(0, rows, MR):
                tile_product(ptr_add(p_qs, (r0 + rt) * e_len), e_len, p_kt, BN,
                             ptr_add(p_sb, rt * BN), BN, e_len, None)
            if nj < BN or mask is not None or (is_causal and j0 + BN - 1 > i0 + r0):
                _mask_tile(sb, rows, i0 + r0, i1, j0, kv_end, mask, is_causal)
            for r in range(rows):
                m_new, a, total = softmax_row_base2(ptr_add(p_sb, r * BN), BN, m[r0 + r])
                m[r0 + r] = m_new
                alpha[r0 + r] = a
                l[r0 + r] = a * l[r0 + r] + total
                # Dropout (a no-op when None): in P·V only; l keeps the undropped sum.
                drop_row(ptr_add(p_sb, r * BN), BN, dropout, i0 + r0 + r, j0)
            for rt in range(0, rows, MR):
                for d0 in range(0, ev_pad, NR):
                    tile_product(ptr_add(p_sb, rt * BN), BN, ptr_add(p_vs, d0), ev_pad,
                                 ptr_add(p_acc, (r0 + rt) * ev_pad + d0), ev_pad, BN,
                                 ptr_add(p_alpha, r0 + rt))

    for r in range(n):
        i = i0 + r
        if l[r] == 0:  # every key masked (or S == 0): zeros and -inf, as torch
            lse[i] = -np.inf
            for d in range(ev):
                out[i, d] = store(0.0, out)
        else:
            inv = 1 / l[r]
            lse[i] = (m[r] + math.log2(l[r])) * cast(LN2, lse)
            for d in range(ev):
                out[i, d] = store(acc[r * ev_pad + d] * inv, out)


@njit(**INLINE)
def _chunk_rows(n_heads, L):
    """Query rows per task: big chunks amortize K/V packing, small ones fill the cores.

    Depends on the shape only (never on the thread count), so results stay bitwise stable.
    """
    if n_heads * ((L + CHUNK - 1) // CHUNK) >= 16:
        return CHUNK
    return BM


@njit(parallel=True, **KERNEL)
def forward(q, k, v, mask, is_causal, scale, out, lse, dropout=None):
    """Batched attention forward, parallel over batch x head x query chunk.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, L, E)
    k : ndarray, shape (B, H, S, E)
        ``Hq`` must be a multiple of ``H``; query head ``h`` reads key/value head
        ``h // (Hq // H)`` (grouped-query attention; ``H == Hq`` is plain attention).
    v : ndarray, shape (B, H, S, Ev)
    mask : None or ndarray, shape (B, Hq, L, S)
        bool (True takes part) or float of the storage dtype (added to the scores). Broadcast
        views with zero strides are read in place.
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` (top-left aligned).
    scale : float
        Multiplies ``q · k``.
    out : ndarray, shape (B, Hq, L, Ev)
        Written.
    lse : ndarray, shape (B, Hq, L)
        Written; its dtype is the compute dtype (float32, or float64 for float64 storage).
    dropout : None or tuple, optional
        ``(seed, threshold, inv_keep, batch_offset)`` typed ``(uint64, uint64, float64,
        int64)``, as made by :func:`sdpa_numba.dropout.params`: drops probabilities of
        (batch ``batch_offset + b``, query head ``h``, row, key) with the counter-based stream
        of :mod:`sdpa_numba.dropout`, scaling kept ones by ``inv_keep``. None: no dropout.

    Notes
    -----
    Storage dtypes are float32, float64, and float16 passed as ``uint16`` views. Any strides.
    Arguments are trusted: the Python API validates them.
    """
    b_len, hq, L, _ = q.shape
    group = hq // k.shape[1]
    chunk = _chunk_rows(b_len * hq, L)
    n_chunks = (L + chunk - 1) // chunk
    n_tasks = b_len * hq * n_chunks
    # Static schedule: each thread gets a contiguous run of tasks, i.e. whole heads with all
    # their chunks, so causal work (cheap early chunks, costly late ones) evens out per thread.
    for t in prange(n_tasks):
        bh = t // n_chunks
        c = t % n_chunks
        b = bh // hq
        h = bh % hq
        i0 = c * chunk
        i1 = min(L, i0 + chunk)
        kh = h // group
        dh = head_dropout(dropout, b, h)
        if mask is None:
            attend_rows(q[b, h], k[b, kh], v[b, kh], None, is_causal, scale,
                        out[b, h], lse[b, h], i0, i1, dh)
        else:
            attend_rows(q[b, h], k[b, kh], v[b, kh], mask[b, h], is_causal, scale,
                        out[b, h], lse[b, h], i0, i1, dh)


@njit(**KERNEL)
def forward_head(q, k, v, mask, is_causal, scale, out, lse):
    """Serial attention forward of one head, for callers that parallelize themselves.

    Parameters
    ----------
    q : ndarray, shape (L, E)
    k : ndarray, shape (S, E)
    v : ndarray, shape (S, Ev)
    mask : None or ndarray, shape (L, S)
        bool (True takes part) or float (added to the scores).
    is_causal : bool
    scale : float
    out : ndarray, shape (L, Ev)
        Written.
    lse : ndarray, shape (L,)
        Written; its dtype is the compute dtype.

    Notes
    -----
    Runs on the calling thread only, so it can be called from a user's ``prange`` loop over
    heads. Gives bitwise the same rows as :func:`forward`.
    """
    L = q.shape[0]
    for i0 in range(0, L, CHUNK):
        attend_rows(q, k, v, mask, is_causal, scale, out, lse, i0, min(L, i0 + CHUNK))
