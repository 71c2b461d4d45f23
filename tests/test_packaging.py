"""Packaging: one source for the version, and an sdist whose tests collect."""

import importlib.metadata
import os
import subprocess
import sys
import tarfile

import pytest

import sdpa_numba

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version_comes_from_the_package():
    assert importlib.metadata.version("sdpa_numba") == sdpa_numba.__version__


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    from setuptools import build_meta

    out = tmp_path_factory.mktemp("sdist")
    cwd = os.getcwd()
    os.chdir(ROOT)  # build_meta builds the project in the current directory
    try:
        name = build_meta.build_sdist(str(out))
    finally:
        os.chdir(cwd)
    with tarfile.open(out / name) as tar:
        tar.extractall(out, filter="data")
        names = tar.getnames()
    top = names[0].split("/")[0]
    return out / top, {n.split("/", 1)[1] for n in names if "/" in n}


def test_sdist_has_the_license_changelog_typing_marker_and_test_helpers(sdist):
    _, names = sdist
    for path in ("LICENSE", "CHANGELOG.md", "sdpa_numba/py.typed", "tests/conftest.py",
                 "tests/checks.py", "tests/cuda/conftest.py", "mkdocs.yml"):
        assert path in names, path
    assert not any(n.endswith((".pyc", ".nbi", ".nbc")) for n in names)


def test_sdist_tests_collect(sdist):
    top, _ = sdist
    env = dict(os.environ, PYTHONPATH=str(top))
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", "tests"], cwd=top, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "error" not in run.stdout.lower().splitlines()[-1], run.stdout[-2000:]
