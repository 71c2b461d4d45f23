"""Every measured figure in the docs is written by docs/make_numbers.py from current code."""

import importlib.util
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
_spec = importlib.util.spec_from_file_location("make_numbers", DOCS / "make_numbers.py")
make_numbers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_numbers)

#: A measured speed or time: "123.4 GFLOP/s", "5.2 GB/s", "52.92 ms", "1.24x torch".
FIGURE = re.compile(r"\d[\d.,]*\s*(GFLOP/s|GB/s|ms\b|µs\b|x torch)")
PAGES = sorted(DOCS.glob("*.md"))


def test_each_block_has_a_generator_and_each_generator_a_block():
    names = [n for p in PAGES for n in make_numbers.blocks(p.read_text())]
    assert sorted(names) == sorted(set(names)), "a block appears twice"
    assert set(names) == set(make_numbers.GENERATORS)


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_no_measured_figure_outside_a_generated_block(page):
    outside = make_numbers.BLOCK.sub("", page.read_text())
    assert not FIGURE.findall(outside), [m.group(0) for m in FIGURE.finditer(outside)]


def test_replace_block_rewrites_only_its_block():
    text = ("a\n<!-- numbers: x -->\nold\n<!-- /numbers -->\nb\n"
            "<!-- numbers: y -->\nkeep\n<!-- /numbers -->\n")
    new = make_numbers.replace_block(text, "x", "new 1.0 GFLOP/s\n")
    assert new == text.replace("old", "new 1.0 GFLOP/s")
    with pytest.raises(KeyError):
        make_numbers.replace_block(text, "z", "")
