"""torch bfloat16 tensors through sdpa_numba.torch (CPU kernels): values and gradients
against torch's SDPA computed in float32 on the same (bfloat16-valued) inputs.

Forward: every element within 1 bf16 ulp of torch's float32 result rounded to bfloat16 (plus
float32's absolute error near zero), as against the float64 reference (bf16_checks).
Gradients: relative Frobenius error against torch's float32 gradients at most 1e-2, and no
more than torch's own bfloat16 SDPA makes (x 1.5 + bf16's unit roundoff): both use the
bfloat16 output in ``D = rowsum(dO * O)``, whose rounding the float32 gradients do not have
(see bf16_checks: up to 4.4e-3 measured on these sizes).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")

from bf16_checks import UNIT_ROUNDOFF, bf16_ulp  # noqa: E402

import sdpa_numba.torch as snt  # noqa: E402

F = torch.nn.functional


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


CASES = [
    ((2, 3, 17, 8), (2, 3, 33, 8), (2, 3, 33, 5), {}),
    ((1, 4, 19, 16), (1, 2, 19, 16), (1, 2, 19, 16), {"is_causal": True, "enable_gqa": True}),
    ((2, 2, 9, 4), (2, 2, 13, 4), (2, 2, 13, 7), {"mask": "additive"}),
    ((2, 2, 9, 4), (2, 2, 13, 4), (2, 2, 13, 7), {"mask": "bool"}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_values_and_gradients_match_torch_float32(case):
    qs, ks, vs, kw = CASES[case]
    kw = dict(kw)
    g = torch.Generator().manual_seed(case)
    q, k, v = (torch.randn(s, generator=g).bfloat16() for s in (qs, ks, vs))
    mask = None
    kind = kw.pop("mask", None)
    if kind == "additive":
        mask = torch.randn(qs[-2], ks[-2], generator=g).bfloat16()
    elif kind == "bool":
        mask = torch.rand(qs[-2], ks[-2], generator=g) < 0.7
        mask[:, 0] = True
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = snt.scaled_dot_product_attention(*leaves, mask, **kw)
    assert out.dtype == torch.bfloat16 and out.shape == qs[:-1] + vs[-1:]

    ref_leaves = [t.float().requires_grad_() for t in (q, k, v)]
    m32 = mask.float() if kind == "additive" else mask
    ref = F.scaled_dot_product_attention(*ref_leaves, m32, **kw)
    rounded = ref.detach().bfloat16()
    diff = (out.detach().double() - rounded.double()).abs().numpy()
    ulp = bf16_ulp(rounded.float().numpy())
    assert (diff <= ulp + 1e-5 * float(ref.detach().abs().max())).all()

    grad = torch.randn(out.shape, generator=g).bfloat16()
    out.backward(grad)
    ref.backward(grad.float())
    tb_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*tb_leaves, mask, **kw).backward(grad)
    for name, a, r, tb in zip("qkv", leaves, ref_leaves, tb_leaves):
        assert a.grad.dtype == torch.bfloat16, name
        ours, torchs = _rel(a.grad, r.grad), _rel(tb.grad, r.grad)
        assert ours <= 1e-2, (name, ours)
        assert ours <= 1.5 * torchs + UNIT_ROUNDOFF, (name, ours, torchs)


def test_bfloat16_tensor_views_are_read_in_place():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 11, 3, 8, generator=g).bfloat16().transpose(1, 2)  # BLHD -> BHLD view
    out = snt.scaled_dot_product_attention(x, x, x, is_causal=True)
    ref = F.scaled_dot_product_attention(x.float(), x.float(), x.float(), is_causal=True)
    assert out.dtype == torch.bfloat16
    assert _rel(out.float(), ref) <= UNIT_ROUNDOFF


def test_mixed_bfloat16_and_float32_is_a_type_error():
    b = torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        snt.scaled_dot_product_attention(b, b.float(), b)
