"""Property tests: random shapes, layouts, masks, dtypes and scales against the reference."""

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from checks import check

dims = st.integers(1, 4)
seq = st.sampled_from([1, 2, 3, 5, 17, 63, 64, 65, 130])
head = st.sampled_from([1, 3, 8, 16, 33, 64, 65])


@st.composite
def problems(draw):
    B, L, S, E, Ev = draw(dims), draw(seq), draw(seq), draw(head), draw(head)
    h = draw(st.sampled_from([1, 2]))
    gqa = draw(st.booleans())
    hq = h * draw(st.sampled_from([1, 3])) if gqa else h
    dtype = draw(st.sampled_from([np.float32, np.float64, np.float16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def make(shape):
        # Random layout: C order, a transposed copy seen back through a transpose, or a
        # strided slice of a bigger array.
        layout = draw(st.sampled_from(["c", "transposed", "sliced"]))
        if layout == "transposed":
            a = rng.standard_normal(shape[::-1]).astype(dtype).T
        elif layout == "sliced":
            big = rng.standard_normal(tuple(2 * n for n in shape)).astype(dtype)
            a = big[tuple(slice(None, None, 2) for _ in shape)]
        else:
            a = rng.standard_normal(shape).astype(dtype)
        return a

    q, k, v = make((B, hq, L, E)), make((B, h, S, E)), make((B, h, S, Ev))
    kw = dict(is_causal=draw(st.booleans()), enable_gqa=gqa)
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(-2.0, 2.0, allow_nan=False))
    kind = draw(st.sampled_from(["none", "bool", "additive"]))
    if kind != "none":
        full = (B, hq, L, S)
        mshape = tuple(n if draw(st.booleans()) else 1 for n in full)
        mshape = mshape[draw(st.integers(0, 2)):]
        if kind == "bool":
            kw["attn_mask"] = rng.random(mshape) < 0.8
        else:
            m = rng.standard_normal(mshape)
            m[rng.random(mshape) < 0.1] = -np.inf
            kw["attn_mask"] = m.astype(dtype)
    return q, k, v, kw


def _fixed(L, S, dtype, **kw):
    """A fixed problem for an @example: the smallest shapes that caught planted bugs."""
    rng = np.random.default_rng(L * 1000 + S)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in
               ((1, 2, L, 8), (1, 2, S, 8), (1, 2, S, 3)))
    return q, k, v, kw


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
# the causal mask-skip boundary one row late (2 real rows in the last sub-block)
@example(_fixed(2, 2, np.float32, is_causal=True))
@example(_fixed(66, 66, np.float16, is_causal=True))
# lse off by 1e-4; float16 outputs scaled by 0.9995
@example(_fixed(3, 5, np.float32))
@example(_fixed(3, 5, np.float16))
def test_matches_reference(problem):
    q, k, v, kw = problem
    check(q, k, v, **kw)  # the tolerances of checks.py, measured
