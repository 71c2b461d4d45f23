"""Census of a Numba cache directory: which specializations were compiled, grouped by function.

Run a test file (or anything) with a fresh cache, then read what it compiled::

    export NUMBA_CACHE_DIR=$(mktemp -d)
    python -m pytest tests/test_varlen.py -n0 -p no:cacheprovider
    python scripts/cache_census.py $NUMBA_CACHE_DIR            # per function, by count
    python scripts/cache_census.py $NUMBA_CACHE_DIR --sigs     # and every signature
    python scripts/cache_census.py A B --diff                  # what B compiled that A did not
    python scripts/cache_census.py $NUMBA_CACHE_DIR --near     # specializations that differ
                                                               # only in layout, readonly-ness,
                                                               # Optional/None or a literal

Each index file (``<qualname>-<line>.py3X.nbi``) maps a key (signature, target machine,
hashes of the function's bytecode and of its closure's contents) to a data file. Two keys with
the same function and signature but a different closure hash mean the same kernel was compiled
twice for different closed-over values (a kernel factory called with another literal, or a
closure that pickles differently in another process); the census lists them under "same
signature, compiled more than once". The data files' modification times order the compiles,
and their sizes roughly say how big each one is.
"""

import argparse
import collections
import os
import pickle
import re
import sys


def load(cache_dir):
    """Every cached overload under ``cache_dir``: a list of dicts (function, signature, ...)."""
    import numba  # noqa: F401  (the index's keys are pickled Numba types)

    rows = []
    for root, _dirs, files in os.walk(cache_dir):
        for name in files:
            if not name.endswith(".nbi"):
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                pickle.load(f)  # Numba's version
                _stamp, overloads = pickle.loads(f.read())
            func = name.rsplit(".", 2)[0]  # qualname-line
            module = os.path.basename(root)
            for key, data_name in overloads.items():
                sig, magic, (code_hash, closure_hash) = key
                data = os.path.join(root, data_name)
                st = os.stat(data) if os.path.exists(data) else None
                rows.append({"module": module, "function": func, "sig": str(sig),
                             "target": magic, "code": code_hash[:10],
                             "closure": closure_hash[:10], "bytes": st.st_size if st else 0,
                             "mtime": st.st_mtime if st else 0.0})
    return rows


def census(rows, show_sigs=False, out=sys.stdout):
    by_func = collections.defaultdict(list)
    for r in rows:
        by_func[(r["module"], r["function"])].append(r)
    total = sum(r["bytes"] for r in rows)
    print(f"{len(rows)} specializations of {len(by_func)} functions, "
          f"{total / 1e6:.1f} MB of data files", file=out)
    print(f"{'count':>5} {'MB':>6}  function (source dir)", file=out)
    for (module, func), rs in sorted(by_func.items(), key=lambda kv: -len(kv[1])):
        mb = sum(r["bytes"] for r in rs) / 1e6
        print(f"{len(rs):5d} {mb:6.2f}  {func}  ({module})", file=out)
        if show_sigs:
            for r in sorted(rs, key=lambda r: r["mtime"]):
                print(f"{'':14}{r['sig']}  closure={r['closure']}", file=out)
    dup = collections.defaultdict(list)
    for r in rows:
        dup[(r["module"], r["function"], r["sig"])].append(r)
    twice = {k: v for k, v in dup.items() if len(v) > 1}
    print(f"\nsame signature, compiled more than once: {len(twice)}", file=out)
    for (module, func, sig), rs in sorted(twice.items()):
        why = sorted({("closure " + r["closure"]) for r in rs} | {str(r["target"][:2])
                                                                  for r in rs})
        print(f"  {len(rs)}x {func} {sig}\n      differ in: {', '.join(why)}", file=out)
    targets = collections.Counter(str(r["target"]) for r in rows)
    if len(targets) > 1:
        print("\nmore than one target machine in the cache:", file=out)
        for t, n in targets.items():
            print(f"  {n:5d}  {t[:160]}", file=out)


_NEAR = [
    # an Optional array, an array and None in one position: one "maybe array"
    (re.compile(r"OptionalType\((readonly )?array\((\w+), (\d)d, \w\)\)"), r"MAYBE(\2, \3)"),
    (re.compile(r"Array\((\w+), (\d), '\w', (True|False), aligned=True\)"), r"ARRAY(\1, \2)"),
    (re.compile(r"(readonly )?array\((\w+), (\d)d, \w\)"), r"ARRAY(\2, \3)"),
    (re.compile(r"Literal\[int\]\(-?\d+\)"), "int64"),
    (re.compile(r"omitted\(default=None\)"), "none"),
]


def near_key(sig):
    """``sig`` with array layouts, readonly flags and integer literals erased (so that
    specializations differing only in those compare equal)."""
    for pattern, repl in _NEAR:
        sig = pattern.sub(repl, sig)
    return re.sub(r"MAYBE\((\w+), (\d)\)|ARRAY\((bool), (\d)\)", r"ARRAY(\1\3, \2\4)",
                  sig)


def near(rows, out=sys.stdout):
    """Specializations of one function (same target machine) that differ only in array
    layout, readonly-ness, an integer literal or an omitted argument: each extra one is a
    compile that a caller's incidental choice made."""
    groups = collections.defaultdict(list)
    for r in rows:
        groups[(r["module"], r["function"], str(r["target"]), near_key(r["sig"]))].append(r)
    extra = 0
    for (module, func, _t, _k), rs in sorted(groups.items(), key=lambda kv: kv[0][1]):
        if len(rs) < 2:
            continue
        extra += len(rs) - 1
        print(f"{len(rs)}x {func}  ({sum(r['bytes'] for r in rs) / 1e6:.2f} MB)", file=out)
        first = rs[0]["sig"].split(", ")
        for r in rs:
            parts = r["sig"].split(", ")
            changed = [b for a, b in zip(first, parts) if a != b] if r is not rs[0] else []
            print(f"    {r['sig'][:150]}{' ...' if len(r['sig']) > 150 else ''}", file=out)
            if changed:
                print(f"      differs from the first in: {', '.join(changed[:8])}", file=out)
    print(f"{extra} specializations beyond one per such group", file=out)


def diff(a_rows, b_rows, out=sys.stdout):
    key = lambda r: (r["module"], r["function"], r["sig"], r["closure"])  # noqa: E731
    have = {key(r) for r in a_rows}
    new = [r for r in b_rows if key(r) not in have]
    print(f"{len(new)} specializations in the second cache and not the first:", file=out)
    for r in sorted(new, key=lambda r: (r["function"], r["sig"])):
        print(f"  {r['function']}  {r['sig']}  closure={r['closure']}", file=out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cache_dirs", nargs="+")
    p.add_argument("--sigs", action="store_true", help="list every signature")
    p.add_argument("--diff", action="store_true", help="what the second dir has, the first not")
    p.add_argument("--near", action="store_true",
                   help="specializations differing only in layout, readonly-ness or a literal")
    a = p.parse_args(argv)
    if a.diff:
        if len(a.cache_dirs) != 2:
            p.error("--diff takes two cache directories")
        diff(load(a.cache_dirs[0]), load(a.cache_dirs[1]))
        return
    for d in a.cache_dirs:
        print(f"== {d}")
        if a.near:
            near(load(d))
        else:
            census(load(d), a.sigs)


if __name__ == "__main__":
    main()
