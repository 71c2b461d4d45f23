"""The documentation: its examples run, its figures script runs, its strict build passes.

The examples in docs/examples/ are the code shown on the pages (included with
``--8<--``), so running them here keeps the pages true. The strict mkdocs build runs when
mkdocs and its plugins are installed (``pip install -e '.[docs]'``) and is skipped, saying
so, otherwise.
"""

import importlib.util
import os
import pathlib
import re
import runpy
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = sorted((DOCS / "examples").glob("*.py"))
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python",
                 "latex2mathml", "pymdownx")


def test_there_are_examples():
    names = {p.stem for p in EXAMPLES}
    assert {"api_tour", "njit_batched", "njit_heads_prange", "njit_online_softmax"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    assert f"{path.stem}:" in capsys.readouterr().out  # each example ends by saying it passed


#: Every line each example prints, in order (the expected errors included): an example that
#: stops raising what its comments promise, or prints anything else, fails here.
EXPECTED_OUTPUT = {
    "api_tour": [
        "ValueError: key's last dim must equal query's: query (2, 4, 100, 32), "
        "key (2, 4, 120, 16)",
        "ValueError: dropout_p must be in [0, 1), got 1.0",
        "api_tour: all results match the float64 reference",
    ],
}


@pytest.mark.parametrize("name", list(EXPECTED_OUTPUT))
def test_example_prints_what_it_promises(name, capsys):
    runpy.run_path(str(DOCS / "examples" / f"{name}.py"), run_name="__main__")
    assert capsys.readouterr().out.splitlines() == EXPECTED_OUTPUT[name]


def test_examples_do_not_expect_stale_errors():
    # dropout is implemented: no example may still expect it to be refused
    for path in EXAMPLES:
        assert "NotImplementedError" not in path.read_text(), path.name


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_is_shown_in_the_docs(path):
    include = f'--8<-- "docs/examples/{path.name}"'
    assert any(include in page.read_text() for page in DOCS.glob("*.md")), include


def test_pages_show_the_committed_figures():
    text = (DOCS / "math.md").read_text()
    figures = re.findall(r"\]\((img/[^)]+\.png)\)", text)
    assert len(figures) >= 3
    for rel in figures:
        assert (DOCS / rel).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", rel
    assert "python docs/make_figures.py" in text


def test_make_figures_runs(tmp_path):
    """The figure script, on small samples, into a temporary folder."""
    pytest.importorskip("matplotlib", reason="the figures need matplotlib (the docs extra)")
    spec = importlib.util.spec_from_file_location("make_figures", DOCS / "make_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--out", str(tmp_path), "--pairs", "500", "--rows", "32"])
    for name in ("scaling_variance.png", "softmax_saturation.png", "online_softmax.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_mkdocs_strict_build(tmp_path):
    missing = [m for m in DOCS_PACKAGES if importlib.util.find_spec(m.split(".")[0]) is None
               or importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"docs packages not installed ({', '.join(missing)}): "
                    f"pip install -e '.[docs]' to build the documentation")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    math_page = (site / "math" / "index.html").read_text()
    assert math_page.count("<math") > 20 and "arithmatex" not in math_page  # MathML, no raw TeX
    api_page = (site / "api" / "index.html").read_text()
    for name in ("scaled_dot_product_attention", "scaled_dot_product_attention_backward",
                 "cpu.forward.forward", "cpu.backward.backward", "cpu.forward_head",
                 "cpu.online_softmax_update", "dropout.keep_mask",
                 "reference.attention_backward", "gpu.forward.forward",
                 "gpu.backward.backward", "gpu.attend_row"):
        assert f'id="sdpa_numba.{name}"' in api_page, name
    # Docstrings' Sphinx roles are rendered as code (docs/hooks/roles.py), never as raw text.
    raw = re.compile(r":(func|mod|class|meth|attr|data|obj|exc):(<code>|`)")
    for page in site.rglob("*.html"):
        text = re.sub(r'<span class="(sd|c1|s[12]?)">.*?</span>', "", page.read_text())
        assert not raw.search(text), (page, raw.search(text))
    assert "rel_err" in (site / "usage" / "index.html").read_text()  # the example was included
