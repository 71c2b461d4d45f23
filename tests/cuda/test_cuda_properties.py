"""Property test: random small problems on the CUDA path agree with the float64 reference.

Few examples (the simulator is slow); the named cases are in test_cuda_forward.py.
"""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdpa_cuda_testing import check


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    L, S = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    E, Ev = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    h = draw(st.integers(1, 2))
    gqa = draw(st.booleans())
    hq = h * draw(st.integers(1, 2)) if gqa else h
    batch = draw(st.sampled_from([(), (1,), (2,)]))
    kv_batch = draw(st.sampled_from([batch, (1,) * len(batch)]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((*batch, hq, L, E)).astype(dtype)
    k = rng.standard_normal((*kv_batch, h, S, E)).astype(dtype)
    v = rng.standard_normal((*kv_batch, h, S, Ev)).astype(dtype)
    kind = draw(st.sampled_from(["none", "bool", "additive"]))
    mask = None
    if kind != "none":
        shape = draw(st.sampled_from([(L, S), (hq, 1, S), (*batch, hq, L, S)]))
        keep = rng.random(shape) > 0.3
        mask = keep if kind == "bool" else np.where(
            keep, rng.standard_normal(shape), -np.inf).astype(dtype)
    kw = {"is_causal": draw(st.booleans()), "enable_gqa": gqa,
          "scale": draw(st.sampled_from([None, 0.3, -1.5]))}
    return q, k, v, mask, kw


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_matches_reference(problem):
    q, k, v, mask, kw = problem
    check(q, k, v, mask, **kw)
