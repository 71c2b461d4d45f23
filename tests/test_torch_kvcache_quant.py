"""The serving operators on 8-bit caches: int8, q8_0 and torch's float8 tensors with their
scales (``k_scale``, ``v_scale``, the schemas' last optional arguments), bitwise the NumPy-level
API on the same bytes, the appends written into the caller's caches, schema and fake kernels
checked by opcheck, and bad scales refused with the cache unwritten."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sdpa_numba  # noqa: E402
import sdpa_numba.torch  # noqa: E402,F401

ops = torch.ops.sdpa_numba
FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def quantized(x, fmt):
    """(NumPy cache, NumPy scale, torch cache over the same bytes, torch scale)."""
    values, scale = sdpa_numba.quantize_kv(x, fmt)
    if fmt in FP8:
        t = torch.from_numpy(values.view(np.uint8).copy()).view(FP8[fmt])
    else:
        t = torch.from_numpy(values.copy())
    return values, scale, t, torch.from_numpy(np.asarray(scale).copy())


def problem(fmt, seed=0, B=2, Lq=2, Hq=4, H=2, E=64, S=11, new=2):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Lq, Hq, E)).astype(np.float32)
    kv = [quantized(rng.standard_normal((B, S, H, E)), fmt) for _ in range(2)]
    k, v = (rng.standard_normal((B, new, H, E)).astype(np.float32) for _ in range(2))
    lens = np.array([3, 7], np.int32)
    return q, kv, k, v, lens


def as_numpy(t):
    return t.view(torch.uint8).numpy() if t.dtype in FP8.values() else t.numpy()


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "e4m3fn", "e5m2"])
def test_append_and_read_equal_the_numpy_api(fmt):
    q, ((kn, ks, kt, kst), (vn, vs, vt, vst)), k, v, lens = problem(fmt)
    out, lse = ops.attention_with_kvcache(
        torch.from_numpy(q), kt, vt, torch.from_numpy(lens), torch.from_numpy(k),
        torch.from_numpy(v), k_scale=kst, v_scale=vst)
    want, want_lse = sdpa_numba.attention_with_kvcache(
        q, kn, vn, lens, k=k, v=v, k_scale=ks, v_scale=vs, return_lse=True)
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    # The append was quantized into the caller's tensors (and, int8/q8_0, their scales).
    np.testing.assert_array_equal(as_numpy(kt), kn.view(np.uint8) if fmt in FP8 else kn)
    np.testing.assert_array_equal(as_numpy(vt), vn.view(np.uint8) if fmt in FP8 else vn)
    np.testing.assert_array_equal(kst.numpy(), ks)
    # The read-only operator on the appended caches.
    out, _ = ops.attention_with_kvcache_read(torch.from_numpy(q), kt, vt,
                                             torch.from_numpy(lens + 2), k_scale=kst,
                                             v_scale=vst)
    np.testing.assert_array_equal(out.numpy(), sdpa_numba.attention_with_kvcache(
        q, kn, vn, lens + 2, k_scale=ks, v_scale=vs))


@pytest.mark.parametrize("compiled", [False, True])
def test_public_wrapper_takes_the_scales(compiled):
    from sdpa_numba.torch import attention_with_kvcache

    q, ((kn, ks, kt, kst), (vn, vs, vt, vst)), k, v, lens = problem("int8", seed=1)
    fn = attention_with_kvcache
    if compiled:
        fn = torch.compile(attention_with_kvcache, fullgraph=True, backend="eager")
    qt = torch.from_numpy(q)
    out = fn(qt, kt, vt, torch.from_numpy(lens), k=torch.from_numpy(k), v=torch.from_numpy(v),
             k_scale=kst, v_scale=vst)
    want = sdpa_numba.attention_with_kvcache(q, kn, vn, lens, k=k, v=v, k_scale=ks,
                                             v_scale=vs)
    np.testing.assert_array_equal(out.numpy(), want)
    read = fn(qt, kt, vt, torch.from_numpy(lens + 2), k_scale=kst, v_scale=vst)
    np.testing.assert_array_equal(read.numpy(), sdpa_numba.attention_with_kvcache(
        q, kn, vn, lens + 2, k_scale=ks, v_scale=vs))


def test_opcheck_with_an_int8_cache():
    q, ((_, _, kt, kst), (_, _, vt, vst)), k, v, lens = problem("q8_0", seed=2)
    args = (torch.from_numpy(q), kt, vt, torch.from_numpy(lens))
    torch.library.opcheck(ops.attention_with_kvcache.default,
                          (*args, torch.from_numpy(k), torch.from_numpy(v)),
                          dict(k_scale=kst, v_scale=vst),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.attention_with_kvcache_read.default, args,
                          dict(k_scale=kst, v_scale=vst),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_scales_refused_with_the_cache_unwritten():
    from sdpa_numba.torch import attention_with_kvcache

    q, ((_, _, kt, kst), (_, _, vt, vst)), k, v, lens = problem("int8", seed=3)
    qt, lt, knew, vnew = (torch.from_numpy(x) for x in (q, lens, k, v))
    before = kt.clone(), vt.clone(), kst.clone()
    with pytest.raises(TypeError, match="k_scale"):
        attention_with_kvcache(qt, kt, vt, lt, k=knew, v=vnew, k_scale=kst.to(torch.int32),
                               v_scale=vst)
    with pytest.raises((TypeError, ValueError), match="k_scale"):
        attention_with_kvcache(qt, kt, vt, lt, k=knew, v=vnew, k_scale=kst[:, :3], v_scale=vst)
    with pytest.raises((TypeError, ValueError), match="scale"):
        attention_with_kvcache(qt, kt, vt, lt, k=knew, v=vnew)  # an int8 cache, no scales
    for a, b in zip((kt, vt, kst), before):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="k_cache"):  # not a cache dtype at all
        attention_with_kvcache(qt, kt.to(torch.int16), vt, lt, k_scale=kst, v_scale=vst)
