"""Operands placed right against an inaccessible page: a read or write past either end of an
operand then crashes the process (SIGSEGV) instead of reading a neighbour's memory.

:func:`guarded` builds an array of any shape and byte strides (overlapping, negative, not a
multiple of the item size) whose lowest or highest byte touches a ``PROT_NONE`` page.
:func:`run_cases` runs the CPU forward and backward on every case of :data:`CASES` with every
operand (q, k, v, mask, out, grad_out, the forward's out and lse) so placed, first against the
page after it, then against the page before it, and checks the results against the float64
reference. Run it in a child process (``python tests/guard_pages.py``, as
tests/test_guard_pages.py does): a crash is then a failed test, not a dead test run. The child
prints each case before running it, so the last line printed names the one that crashed.
"""

import ctypes
import mmap
import sys

import numpy as np

PAGE = mmap.PAGESIZE
_PROT_NONE = 0
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_keep = []  # the mappings' ctypes views: an mmap with exports cannot be closed or moved


def _extent(shape, strides, itemsize):
    lo = sum(s * (n - 1) for n, s in zip(shape, strides) if s < 0)
    hi = sum(s * (n - 1) for n, s in zip(shape, strides) if s > 0) + itemsize
    return lo, hi


def guarded(shape, strides, dtype, at_end, rng):
    """An array of ``shape``, byte ``strides`` and ``dtype`` filled with random values (random
    bools for a bool dtype), whose highest byte is the last before an inaccessible page
    (``at_end``) or whose lowest byte is the first after one. Overlapping elements share
    their value."""
    dtype = np.dtype(dtype)
    if 0 in shape:
        return np.zeros(shape, dtype)
    lo, hi = _extent(shape, strides, dtype.itemsize)
    n_pages = (hi - lo) // PAGE + 1
    mm = mmap.mmap(-1, (n_pages + 2) * PAGE)
    view = (ctypes.c_char * len(mm)).from_buffer(mm)
    _keep.append(view)
    addr = ctypes.addressof(view)
    for page in (addr, addr + (n_pages + 1) * PAGE):
        if _libc.mprotect(page, PAGE, _PROT_NONE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
    first = (n_pages + 1) * PAGE - (hi - lo) if at_end else PAGE
    raw = np.ndarray((hi - lo,), np.uint8, buffer=mm, offset=first)
    if dtype == np.bool_:
        raw[:] = rng.random(raw.size) < 0.8
    else:
        n = raw.size // dtype.itemsize
        vals = rng.standard_normal(n).astype(dtype)
        raw[:n * dtype.itemsize] = vals.view(np.uint8)
        raw[n * dtype.itemsize:] = 0
    return np.ndarray(shape, dtype, buffer=mm, offset=first - lo, strides=strides)


def rows(n_rows, n_cols, itemsize, layout):
    """Byte strides of an ``(n_rows, n_cols)`` operand: "c" (contiguous), "pad" (rows one item
    apart more than needed), "overlap" (rows one item apart), "neg" (rows reversed, columns
    reversed), "odd" (rows ``n_cols * itemsize + 2`` bytes apart: not a multiple of the
    item size), "bcast" (every row the same)."""
    return {"c": (n_cols * itemsize, itemsize), "pad": ((n_cols + 1) * itemsize, itemsize),
            "overlap": (itemsize, itemsize), "neg": (-n_cols * itemsize, -itemsize),
            "odd": (n_cols * itemsize + 2, itemsize), "bcast": (0, itemsize)}[layout]


#: (L, S, E, Ev, layout of q/k/v/mask/grad_out, layout of out=): sizes around the kernels'
#: blocks (64 keys forward, 128 backward, 4-row value tiles), odd head dims.
CASES = [(L, S, E, Ev, lay, olay)
         for (L, S, E, Ev) in [(1, 1, 1, 1), (7, 130, 3, 5), (65, 129, 8, 7), (3, 66, 5, 6),
                               (5, 257, 2, 3)]
         for lay, olay in [("c", "c"), ("overlap", "pad"), ("neg", "neg"), ("odd", "odd"),
                           ("pad", "c"), ("bcast", "c")]]

#: Windows (left, right) of the window cases, and their shapes: many more rows than keys.
WINDOWS = [(1, 0), (2, 0), (0, 3)]
WINDOW_CASES = [(300, 3, 8, 8, "c", "c"), (70, 5, 3, 5, "odd", "odd")]


def run_case(L, S, E, Ev, lay, olay, dtype, mask_kind, at_end, seed=0, window=None):
    from sdpa_numba import scaled_dot_product_attention as sdpa
    from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward
    from sdpa_numba import reference

    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    ct = np.float64 if dtype == np.float64 else np.float32

    def g(n_rows, n_cols, layout, dt=dtype):
        dt = np.dtype(dt)
        return guarded((n_rows, n_cols), rows(n_rows, n_cols, dt.itemsize, layout), dt,
                       at_end, rng)

    q, k, v = g(L, E, lay), g(S, E, lay), g(S, Ev, lay)
    def moderate(x):
        # Fields at odd byte strides read arbitrary bit patterns (NaN, inf, 1e38): the
        # check is about addresses, not overflow. (Overlapping elements get one value.)
        if x.size:
            x[...] = np.nan_to_num(np.asarray(x, np.float64)).clip(-3, 3)

    for x in (q, k, v):
        moderate(x)
    mask = None
    if mask_kind == "bool":
        mask = g(L, S, lay, np.bool_)
    elif mask_kind == "additive":
        mask = g(L, S, lay)
        moderate(mask)
    out = g(L, Ev, olay)
    got, lse = sdpa(q, k, v, attn_mask=mask, out=out, return_lse=True, window=window)
    want, want_lse = reference.attention(q, k, v, attn_mask=mask, window=window)
    tol = {np.dtype(np.float16): 3e-3, np.dtype(np.float32): 2e-5,
           np.dtype(np.float64): 1e-12}[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol)
    # the backward, with grad_out, out and lse guarded too
    gout = g(L, Ev, lay)
    moderate(gout)
    o2 = g(L, Ev, olay)
    o2[...] = got
    lse2 = guarded((L,), (np.dtype(ct).itemsize,), ct, at_end, rng)
    lse2[...] = lse
    grads = sdpa_backward(gout, q, k, v, o2, lse2, mask,
                          mask_grad=mask_kind == "additive", window=window)
    want_g = reference.attention_backward(gout, q, k, v, mask, window=window)
    gtol = {np.dtype(np.float16): 3e-2, np.dtype(np.float32): 1e-4,
            np.dtype(np.float64): 1e-10}[dtype]
    for a, b in zip(grads, want_g):
        scale = max(1.0, float(np.abs(b).max())) if b.size else 1.0
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=gtol, atol=gtol * scale)


def run_cases(dtypes=("float32", "float16", "float64"), masks=("none", "bool", "additive")):
    n = 0
    for at_end in (True, False):
        for case in CASES:
            for dtype in dtypes:
                for mask_kind in masks:
                    print("case", case, dtype, mask_kind, "at_end" if at_end else "at_start",
                          flush=True)
                    run_case(*case, dtype, mask_kind, at_end)
                    n += 1
        # Top-left windows that end before the last rows: those rows see no keys at all,
        # and their empty key range starts past the last key (nothing may be read there).
        for window in WINDOWS:
            for case in WINDOW_CASES:
                print("case", case, "float32 window", window,
                      "at_end" if at_end else "at_start", flush=True)
                run_case(*case, "float32", "none", at_end, window=window)
                n += 1
    print("all", n, "cases passed", flush=True)


if __name__ == "__main__":
    run_cases(*(a.split(",") for a in sys.argv[1:]))
