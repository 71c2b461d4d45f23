"""Any host array in, without a copy; results as the caller's kind where that needs no copy."""

import numpy as np
import pytest

from sdpa_numba import host_arrays, reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward

torch = pytest.importorskip("torch")


class OnlyArrayInterface:
    def __init__(self, a):
        self.a = a

    @property
    def __array_interface__(self):
        return self.a.__array_interface__


class OnlyDLPack:
    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class OnlyArray:
    """``__array__`` only: NumPy may copy, so it is taken for inputs and refused for out."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a.copy()


@pytest.fixture
def qkv(rng):
    shapes = ((2, 3, 17, 8), (2, 3, 19, 8), (2, 3, 19, 5))
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _ref(q, k, v, **kw):
    return reference.attention(q, k, v, **kw)[0]


@pytest.mark.parametrize("wrap", [OnlyArrayInterface, OnlyDLPack, OnlyArray, memoryview],
                         ids=["array_interface", "dlpack", "__array__", "buffer"])
def test_other_host_kinds_in_numpy_out(qkv, wrap):
    q, k, v = qkv
    out = sdpa(wrap(q), wrap(k), wrap(v), is_causal=True)
    assert type(out) is np.ndarray
    assert np.abs(out - _ref(q, k, v, is_causal=True)).max() < 1e-5


@pytest.mark.parametrize("wrap", [OnlyArrayInterface, OnlyDLPack, memoryview],
                         ids=["array_interface", "dlpack", "buffer"])
def test_inputs_are_read_in_place(qkv, wrap):
    q = qkv[0]
    assert np.shares_memory(host_arrays.as_numpy("query", wrap(q)), q)


def test_torch_cpu_tensors_in_and_out(qkv):
    q, k, v = (torch.from_numpy(x) for x in qkv)
    q.requires_grad_(True)  # read through detach(): DLPack refuses such tensors
    mask = torch.rand(17, 19, generator=torch.Generator().manual_seed(0)) > 0.3
    out, lse = sdpa(q, k, v, mask, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    want = torch.nn.functional.scaled_dot_product_attention(q.detach(), k, v, mask)
    assert (out - want).abs().max() < 1e-5
    assert np.shares_memory(host_arrays.as_numpy("query", q), qkv[0])
    grads = sdpa_backward(torch.ones_like(out), q, k, v, out, lse, mask)
    assert all(isinstance(g, torch.Tensor) for g in grads)
    ref = reference.attention_backward(np.ones(out.shape), *qkv, mask.numpy())
    for g, r in zip(grads, ref):
        assert np.abs(g.numpy() - r).max() < 1e-4


def test_out_of_another_kind_is_written_and_returned(qkv):
    q, k, v = qkv
    buf = torch.full((2, 3, 17, 5), float("nan"))
    assert sdpa(*(torch.from_numpy(x) for x in qkv), out=buf) is buf
    assert (buf.numpy() - _ref(q, k, v)).__abs__().max() < 1e-5
    plain = np.full((2, 3, 17, 5), np.nan, np.float32)
    wrapped = OnlyDLPack(plain)
    assert sdpa(q, k, v, out=wrapped) is wrapped
    assert np.abs(plain - _ref(q, k, v)).max() < 1e-5


def test_out_that_cannot_be_written_in_place_is_refused(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="out"):
        sdpa(q, k, v, out=OnlyArray(np.empty((2, 3, 17, 5), np.float32)))
    ro = np.empty((2, 3, 17, 5), np.float32)
    ro.flags.writeable = False
    with pytest.raises((TypeError, ValueError), match="out"):
        sdpa(q, k, v, out=OnlyArrayInterface(ro))


def test_kinds_mix_on_the_host(qkv):
    q, k, v = qkv
    out = sdpa(torch.from_numpy(q), OnlyDLPack(k), v)
    assert isinstance(out, torch.Tensor)  # the query's kind
    assert np.abs(out.numpy() - _ref(q, k, v)).max() < 1e-5


def test_unreadable_objects_are_type_errors_naming_the_argument(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="^key must be an array"):
        sdpa(q, object(), v)
    with pytest.raises(TypeError, match="^value must be an array"):
        sdpa(q, k, "not an array")
    with pytest.raises(TypeError, match="query .*bfloat16|query .*DLPack"):
        sdpa(torch.ones(3, 4, dtype=torch.bfloat16), k[0, 0], v[0, 0])
