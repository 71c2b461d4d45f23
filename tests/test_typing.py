"""Types: mypy (strict) sees precise types where a user calls the API, and the public modules
type-check."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("mypy", reason="the type checks need mypy (the test extra)")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = ["api.py", "backward.py", "reference.py", "dropout.py", "_typing.py", "kvcache.py",
          "merge.py", "varlen.py", "cascade.py"]

USER_CODE = """
from typing import Any, assert_type

import numpy as np
import numpy.typing as npt

import sdpa_numba
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward

F16 = npt.NDArray[np.float16]
F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
rng = np.random.default_rng(0)
q: F32 = rng.standard_normal((2, 5, 8), dtype=np.float32)
mask = np.ones((5, 5), bool)

out = sdpa(q, q, q, mask, is_causal=True)
assert_type(out, F32)
out2, lse = sdpa(q, q, q, return_lse=True)
assert_type(out2, F32)
assert_type(lse, F32)
h: F16 = q.astype(np.float16)
out16, lse16 = sdpa(h, h, h, return_lse=True)
assert_type(out16, F16)
assert_type(lse16, F32)
d: F64 = q.astype(np.float64)
assert_type(sdpa(d, d, d, return_lse=True), tuple[F64, F64])
flag: bool = bool(rng.integers(2))
assert_type(sdpa(q, q, q, return_lse=flag), F32 | tuple[F32, Any])

dq, dk, dv = sdpa_backward(out, q, q, q, out, lse)
assert_type(dq, F32)
grads = sdpa_backward(out, q, q, q, out, lse, mask.astype(np.float32), mask_grad=True)
assert_type(grads, tuple[F32, F32, F32, F32])
ref_out, ref_lse = sdpa_numba.reference.attention(q, q, q)
assert_type(ref_out, F64)
assert_type(sdpa_numba.dropout.keep_mask(1, 0.5, (2,), 1, 5, 5), npt.NDArray[np.bool_])
cu = np.array([0, 2, 5], np.int32)
vo, vlse = sdpa_numba.varlen_attention(q, q, q, cu, cu, is_causal=True, return_lse=True)
assert_type(vo, F32)
assert_type(sdpa_numba.varlen_attention(q, q, q, cu, cu), F32)
assert_type(sdpa_numba.varlen_attention_backward(vo, q, q, q, vo, vlse, cu, cu),
            tuple[F32, F32, F32])
"""

#: Misuses that mypy must report (so the check above cannot pass vacuously).
MISUSES = {
    "scale": "sdpa(q, q, q, scale='large')",
    "return_lse": "o, l, x = sdpa(q, q, q, return_lse=True)",
    "seed": "sdpa(q, q, q, seed=0.5)",
    "varlen_return_lse": "o, l, x = sdpa_numba.varlen_attention(q, q, q, cu, cu, "
                         "return_lse=True)",
}


#: Strict for the user's code; sdpa_numba's internals (the jitted kernels) are read for their
#: types but not reported there: the public modules are checked on their own below.
STRICT = "[mypy]\nstrict = True\n\n[mypy-sdpa_numba.*]\nfollow_imports = silent\n"
#: The public modules: mypy's defaults (their untyped private helpers are allowed).
DEFAULT = "[mypy]\n\n[mypy-sdpa_numba.cpu.*,sdpa_numba.gpu.*,sdpa_numba.score.*]\nfollow_imports = silent\n"


def _mypy(tmp_path, config, *args):
    path = tmp_path / f"mypy{abs(hash(config))}.ini"
    path.write_text(config)
    env = dict(os.environ, MYPYPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(path),
                           "--cache-dir", str(tmp_path / "cache"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("mypy")


def test_user_code_sees_precise_types(tmp):
    (tmp / "user.py").write_text(USER_CODE)
    run = _mypy(tmp, STRICT, "user.py")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("name", MISUSES)
def test_misuse_is_reported(tmp, name):
    (tmp / f"misuse_{name}.py").write_text(USER_CODE + MISUSES[name] + "\n")
    run = _mypy(tmp, STRICT, f"misuse_{name}.py")
    assert run.returncode == 1 and f"misuse_{name}.py:" in run.stdout, run.stdout


def test_public_modules_type_check(tmp):
    run = _mypy(tmp, DEFAULT, *(str(ROOT / "sdpa_numba" / m) for m in PUBLIC))
    assert run.returncode == 0, run.stdout + run.stderr


def test_py_typed_marker_is_shipped():
    assert (ROOT / "sdpa_numba" / "py.typed").exists()
