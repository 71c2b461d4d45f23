"""sdpa_numba/reference.py is an independent oracle: NumPy and the standard library only, and
its own restatements (the broadcast reduction, the dropout stream) agree with the package's."""

import ast
import pathlib
import sys

import numpy as np
import pytest

from sdpa_numba import dropout, reference
from sdpa_numba.problem.reductions import sum_to

SOURCE = pathlib.Path(reference.__file__)


def _imports(tree):
    """(module, level) of every import statement anywhere in the module (functions too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level


def test_reference_imports_numpy_and_the_standard_library_only():
    found = list(_imports(ast.parse(SOURCE.read_text())))
    assert found  # the walk sees the imports (numpy at least)
    bad = [(m, lvl) for m, lvl in found
           if lvl > 0 or m.split(".")[0] not in {"numpy"} | sys.stdlib_module_names]
    assert not bad, (f"{SOURCE} imports {bad}: the reference must not use the package's "
                     f"code (nor anything but NumPy and the standard library)")


def test_reference_import_check_sees_package_imports():
    # the check above flags the kinds of import the reference once had
    tree = ast.parse("from .problem.reductions import sum_to\n"
                     "def f():\n    from sdpa_numba.dropout import keep_mask\n")
    assert list(_imports(tree)) == [("problem.reductions", 1), ("sdpa_numba.dropout", 0)]


@pytest.mark.parametrize("full, shape", [
    ((2, 3, 4, 5), (2, 3, 4, 5)), ((2, 3, 4, 5), (3, 4, 5)), ((2, 3, 4, 5), (1, 3, 1, 5)),
    ((2, 3, 4, 5), (4, 1)), ((2, 3, 4, 5), ()), ((3, 1, 4), (1, 1, 4)), ((2, 0, 3), (1, 3)),
    ((4, 5), (5,)), ((2, 3, 4, 5), (2, 1, 4, 1)),
])
def test_own_reduction_is_the_package_sum_to_bitwise(full, shape):
    x = np.random.default_rng(7).standard_normal(full) * 1e3
    mine = reference._sum_to(x, shape)
    theirs = sum_to(x, shape)
    assert mine.shape == tuple(shape)
    np.testing.assert_array_equal(mine.view(np.uint64), theirs.view(np.uint64))
    # and what it means: the sum of the broadcast copies' contributions
    lead = len(full) - len(shape)
    expect = x.sum(axis=tuple(range(lead))) if lead else x
    for a, n in enumerate(shape):
        if n == 1 and full[lead + a] != 1:
            expect = expect.sum(axis=a, keepdims=True)
    np.testing.assert_allclose(mine, expect.reshape(shape), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("seed, p, batch, heads, L, S", [
    (0, 0.5, (2,), 3, 4, 5), (1234, 0.5, (2,), 2, 3, 70), (2**64 - 1, 0.1, (2, 3), 1, 7, 9),
    (42, 0.0, (), 2, 5, 3), (9, 0.999, (1,), 1, 6, 6), (5, 0.3, (2,), 2, 0, 4),
])
def test_own_dropout_stream_is_the_package_keep_mask(seed, p, batch, heads, L, S):
    mine = reference._keep_mask(seed, p, batch, heads, L, S)
    assert mine.shape == (*batch, heads, L, S) and mine.dtype == np.bool_
    np.testing.assert_array_equal(mine, dropout.keep_mask(seed, p, batch, heads, L, S))
    assert (int(reference._GAMMA), int(reference._MIX1), int(reference._MIX2)) == (
        dropout.GAMMA, dropout.MIX1, dropout.MIX2)
