"""scripts/mutation_check.py stays in step with the code: each mutant's ``old`` text occurs
exactly once in its file (a refactor that moves or rewrites a mutated line shows here, in the
default run, instead of at the next mutation run)."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "mutation_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MUTANTS = _load().MUTANTS


def test_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


@pytest.mark.parametrize("m", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_text_found_exactly_once(m):
    path = ROOT / m.path
    assert path.is_file(), (f"mutant {m.name!r} of scripts/mutation_check.py: its file "
                            f"{m.path} does not exist (moved?): point the mutant at the file "
                            f"that now holds {m.old!r}")
    count = path.read_text().count(m.old)
    assert count == 1, (f"mutant {m.name!r} of scripts/mutation_check.py: its old text "
                        f"{m.old!r} occurs {count} times in {m.path} (must be exactly once: "
                        f"update the mutant to the code that now does what it mutates: "
                        f"{m.description})")
    assert m.old != m.new, f"mutant {m.name!r}: old and new texts are the same"
