"""No kernel reads or writes past either end of an operand: every operand of the CPU forward
and backward placed against an inaccessible page (tests/guard_pages.py), in a child process so
that a crash fails this test instead of ending the test run."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_operands_against_guard_pages():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    r = subprocess.run([sys.executable, os.path.join(HERE, "guard_pages.py")], env=env,
                       capture_output=True, text=True, timeout=900)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, (f"exit status {r.returncode} (-11: a segfault) at "
                               f"{lines[-1] if lines else '(nothing printed)'}\n{r.stderr[-3000:]}")
    assert lines[-1].startswith("all"), r.stdout[-2000:]
