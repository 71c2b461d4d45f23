"""The variants' table (sdpa_numba.problem.variant_table): the public signatures, the refusal
of unknown keywords and of variants a target does not run, and the torch operators' schemas
all come from it. No kernel runs here."""

import dataclasses
import inspect
import types

import numpy as np
import pytest

import sdpa_numba
from sdpa_numba.problem import variant_table as vt

PUBLIC = [sdpa_numba.scaled_dot_product_attention,
          sdpa_numba.scaled_dot_product_attention_backward, sdpa_numba.varlen_attention,
          sdpa_numba.varlen_attention_backward, sdpa_numba.attention_with_kvcache,
          sdpa_numba.kvcache_plan]


@pytest.mark.parametrize("func", PUBLIC, ids=lambda f: f.__name__)
def test_signatures_spell_out_the_variants(func):
    params = inspect.signature(func).parameters
    kvcache = "kvcache" in func.__name__
    for v in vt.VARIANTS:
        if kvcache and not v.kvcache:
            assert v.name not in params
            continue
        p = params[v.name]
        assert p.kind is p.KEYWORD_ONLY
        want = "bottom_right" if kvcache and v.name == "alignment" else v.default
        assert p.default == want


def _args(func):
    q = np.zeros((1, 2, 3, 4), np.float32)
    if func is sdpa_numba.scaled_dot_product_attention:
        return (q, q, q)
    if func is sdpa_numba.scaled_dot_product_attention_backward:
        return (q, q, q, q, q, q[..., 0])
    cu = np.array([0, 3])
    p = np.zeros((3, 2, 4), np.float32)
    if func is sdpa_numba.varlen_attention:
        return (p, p, p, cu, cu)
    if func is sdpa_numba.varlen_attention_backward:
        return (p, p, p, p, p, np.zeros((2, 3), np.float32), cu, cu)
    return (np.zeros((1, 1, 2, 4), np.float32), q.transpose(0, 2, 1, 3),
            q.transpose(0, 2, 1, 3), 1)


@pytest.mark.parametrize("func", PUBLIC, ids=lambda f: f.__name__)
def test_an_unknown_keyword_is_a_type_error_naming_it(func):
    with pytest.raises(TypeError, match=f"{func.__name__}.*'windw'"):
        func(*_args(func), windw=(1, 1))


def test_kvcache_functions_refuse_score_mod_grad():
    func = sdpa_numba.attention_with_kvcache
    with pytest.raises(TypeError, match="score_mod_grad"):
        func(*_args(func), score_mod_grad=lambda *a: 1.0)


def test_a_variant_its_target_does_not_run_is_refused(monkeypatch):
    host_only = dataclasses.replace(vt.BY_NAME["softcap"], targets=("host",))
    monkeypatch.setitem(vt.BY_NAME, "softcap", host_only)
    cuda = types.SimpleNamespace(name="cuda")
    with pytest.raises(NotImplementedError, match="softcap is not built for cuda arrays"):
        vt.check_names("f", {"softcap": 2.0}, target=cuda)
    vt.check_names("f", {"softcap": None}, target=cuda)  # left at its default: fine
    vt.check_names("f", {"softcap": 2.0}, target=types.SimpleNamespace(name="host"))


def test_torch_schemas_carry_the_table():
    torch = pytest.importorskip("torch")
    import sdpa_numba.torch  # noqa: F401  (registers the operators)

    for op in ("attention_forward", "attention_backward", "varlen_attention_forward",
               "varlen_attention_backward", "attention_with_kvcache",
               "attention_with_kvcache_read"):
        names = [a.name for a in getattr(torch.ops.sdpa_numba, op).default._schema.arguments]
        for v in vt.VARIANTS:
            if v.torch == "window":
                assert {"window_left", "window_right"} <= set(names), op
            elif v.torch is not None:
                assert v.name in names, (op, v.name)
            else:
                assert v.name not in names, (op, v.name)
