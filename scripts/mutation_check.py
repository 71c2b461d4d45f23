"""Mutation check: plant known bugs in the kernels, one at a time, and see the tests catch them.

Each mutant is an exact text replacement in one file of the package (the ``old`` text must
occur exactly once: the script fails loudly otherwise, so the list stays in step with the
code). For each mutant the repository is copied to a scratch directory (without ``.git``,
``__pycache__`` and Numba's ``.nbi``/``.nbc`` cache files), the replacement is applied, and
the mutant's fast tests run there with ``pytest -x -q`` under a fresh ``NUMBA_CACHE_DIR`` (a
stale cache would run the unmutated kernels) and a per-mutant timeout. A mutant is *caught*
when pytest fails; *missed* when it passes. Every test a mutant runs is part of the default
test run (``python -m pytest -q``), so "caught" here means caught by that run.

    python scripts/mutation_check.py                 # every mutant, one at a time
    python scripts/mutation_check.py --jobs 2        # two mutants at once
    python scripts/mutation_check.py --only causal_mask_skip_late --only lse_offset
    python scripts/mutation_check.py --list          # names and descriptions only
    python scripts/mutation_check.py --baseline      # first run every selection unmutated

Exit status: 0 when every mutant run was caught, 1 when one was missed (or timed out), 2
when a mutant's ``old`` text is not found exactly once.

Add a mutant for every new kernel or variant (window bounds, paging, cu_seqlens offsets,
merge, ...): the list grows with the code.
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]

F = "sdpa_numba/cpu/forward.py"
B = "sdpa_numba/cpu/backward.py"
CF = "sdpa_numba/gpu/forward.py"
CB = "sdpa_numba/gpu/backward.py"

# Test selections (all part of the default run). Small and fast where possible: a mutant that
# is caught stops at the first failure (-x); only a missed one runs its whole selection.
FWD = ["tests/test_forward.py"]
FWD_CAUSAL = ["tests/test_forward.py", "-k", "causal or boundary or torch"]
FWD_F16 = ["tests/test_forward.py", "-k", "float16"]
FWD_BOUNDARY = ["tests/test_forward.py", "-k", "boundary"]
DROP = ["tests/test_dropout.py"]
BWD = ["tests/test_backward.py"]
BWD_CAUSAL = ["tests/test_backward.py", "-k", "causal"]
CUDA_FWD = ["tests/cuda/test_cuda_forward.py"]
CUDA_DROP = ["tests/cuda/test_cuda_dropout.py"]
CUDA_BWD = ["tests/cuda/test_cuda_backward.py"]
HARD_STRIDES = ["tests/test_hardening_numerics.py", "-k", "strides"]
HARD_LONG = ["tests/test_hardening_numerics.py", "-k", "long_sequence"]
GUARD = ["tests/test_guard_pages.py"]
R = "sdpa_numba/score/recipe.py"
VAR_WINDOW = ["tests/test_variants.py", "-k", "window"]
VAR_FWD = ["tests/test_variants.py"]
VAR_BWD = ["tests/test_variants_backward.py"]
CUDA_VAR = ["tests/cuda/test_cuda_variants.py"]
CHUNKS = ["tests/test_chunk.py", "-k", "forward_against or keys_outside or decode_reads"]
#: The element test (in_window) runs in the decode kernel's cut blocks (and on the GPU).
CHUNK_ELEMENTS = ["tests/test_kvcache.py", "-k", "variants and chunk"]
KV = ["tests/test_kvcache.py"]
MERGE = ["tests/test_merge.py"]
#: The AVX2 register passes: the host's kernels where it has no AVX-512, and a subprocess
#: compiling them with AVX-512 off where it has.
NARROW = ["tests/test_narrow_vectors.py"]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple
    description: str


def M(name, path, old, new, tests, description):
    return Mutant(name, path, old, new, tuple(tests), description)


MUTANTS = [
    # --- CPU forward: causal bounds and block skips
    M("causal_diagonal_off_by_one", F,
      "for i in range(min(max(i_begin - i_first, 0), BM)):",
      "for i in range(min(max(i_begin - i_first - 1, 0), BM)):",
      FWD_CAUSAL, "causal mask lets query i see key i + 1"),
    M("causal_kv_end_short", F,
      "j_begin, kv_end = key_range(r, i0, i1 - 1, s_len)",
      "j_begin, kv_end = key_range(r, i0, i1 - 2, s_len)",
      FWD_CAUSAL, "causal: the task's last row never sees its own key"),
    M("causal_n_keys_short", F,
      "n_keys = min(nj, hi - j0)",
      "n_keys = min(nj, hi - j0 - 1)",
      FWD_CAUSAL, "causal: the sub-block's key count one short (block skip)"),
    M("causal_mask_skip_late", F,
      "in_window = window_covers(r, i_first, i_last, j0, j0 + n_keys - 1)",
      "in_window = window_covers(r, i_first, i_last, j0, j0 + n_keys - 2)",
      FWD_CAUSAL, "causal: the mask-skip boundary one row late (the audit's mutant)"),
    # --- CPU forward: tails, alpha, D, scale, mask strides, lse
    M("tail_rows_dropped", F,
      "n_pad = (n + BM - 1) // BM * BM",
      "n_pad = max(n // BM * BM, BM)",
      FWD_BOUNDARY, "query tail: rows past the last whole sub-block are not computed"),
    M("tail_keys_full_block", F,
      "nj = min(BN, kv_end - j0)",
      "nj = min(BN - 1, kv_end - j0)",
      FWD, "key blocks: the last key of every full block is skipped"),
    M("alpha_not_applied_to_l", F,
      "l_new[i] = a[i] * l[i] + total[i]",
      "l_new[i] = l[i] + total[i]",
      FWD, "online softmax: the running sum is not rescaled by alpha"),
    M("head_dim_E_short", "sdpa_numba/cpu/forward.py",
      "ptr_add(st, j * BM), BM, e_len,",
      "ptr_add(st, j * BM), BM, e_len - (e_len > 64),",
      FWD, "scores: the last of E > 64 query/key columns ignored"),
    M("value_dim_Ev_rows", F,
      "return (ev + 3) // 4 * 4",
      "return ev // 4 * 4",
      FWD, "accumulator rows for Ev not a multiple of 4 too few"),
    M("scale_off", F,
      "_pack_queries(q, i0, n, n_pad, cast(c, like), qt)",
      "_pack_queries(q, i0, n, n_pad, cast(c, like) * cast(1.00002, like), qt)",
      FWD, "scale off by 2e-5 (relative)"),
    M("lse_offset", F,
      "lse[i] = m_r + math.log(l_r)",
      "lse[i] = m_r + math.log(l_r) + cast(1e-4, lse)",
      FWD, "lse off by 1e-4 (the audit's mutant)"),
    M("mask_block_relative_column", F,
      "row[i] = masked_score(row[i], mask[i_first + i, jj])",
      "row[i] = masked_score(row[i], mask[i_first + i, j])",
      FWD, "mask read at the block-relative key column (a stride/offset slip)"),
    M("mask_gqa_kv_head", F,
      "_attend_rows_by_symbol(q[b, h], k[b, kh], v[b, kh], mask[b, h], r",
      "_attend_rows_by_symbol(q[b, h], k[b, kh], v[b, kh], mask[b, kh], r",
      FWD, "GQA: the mask read at the key/value head instead of the query head"),
    # --- float16 conversion
    M("f16_store_scaled", "sdpa_numba/cpu/storage.py",
      "return lambda x, like: float32_to_half_bits(np.float32(x))",
      "return lambda x, like: float32_to_half_bits(np.float32(x) * np.float32(0.9995))",
      FWD_F16, "float16 outputs scaled by 0.9995 (the audit's mutant)"),
    M("f16_load_last_bit", "sdpa_numba/cpu/storage.py",
      "return lambda x: half_bits_to_float32(x)",
      "return lambda x: half_bits_to_float32(x | np.uint16(1))",
      FWD_F16, "float16 inputs read with their last mantissa bit set"),
    # --- dropout stream
    M("dropout_gamma_both", "sdpa_numba/dropout.py",
      "\nGAMMA = 0x9E3779B97F4A7C15\n",
      "\nGAMMA = 0x9E3779B97F4A7C17\n",
      DROP, "a stream constant changed in the kernels and dropout.keep_mask alike "
      "(known answers)"),
    M("dropout_mix_both", "sdpa_numba/dropout.py",
      "\nMIX2 = 0x94D049BB133111EB\n",
      "\nMIX2 = 0x94D049BB133111ED\n",
      DROP + CUDA_DROP,
      "the second mix constant changed in the kernels and dropout.keep_mask alike"),
    M("dropout_gamma_both_cuda_suite", "sdpa_numba/dropout.py",
      "\nGAMMA = 0x9E3779B97F4A7C15\n",
      "\nGAMMA = 0x9E3779B97F4A7C17\n",
      CUDA_DROP, "the same, against the CUDA suite alone (its own known answers)"),
    M("dropout_shift_kernel", "sdpa_numba/score/dropout.py",
      "_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)",
      "_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(31)",
      DROP, "the kept test reads bits >> 31 (the kernels' stream, not the NumPy reference)"),
    M("dropout_row_index", "sdpa_numba/cpu/dropout.py",
      "rk = stream_step(dropout[0], i_first + i)",
      "rk = stream_step(dropout[0], i_first + i + (i_first > 0))",
      DROP, "dropout: rows past the first sub-block draw the next row's bits"),
    M("dropout_batch_offset", "sdpa_numba/cpu/dropout.py",
      "head_key(dropout[0], dropout[3] + b, h)",
      "head_key(dropout[0], b, h)",
      DROP, "dropout: a launch's batch offset ignored"),
    # --- CPU backward
    M("bwd_causal_block_stop", B,
      "kb_stop = min(c1, (je + BK - 1) // BK)",
      "kb_stop = min(c1, (je + BK - 2) // BK)",
      BWD_CAUSAL, "backward causal block skip one row early"),
    M("bwd_causal_mask_skip_late", B,
      "or not window_covers(r, i0, i0 + nv - 1, j0, j0 + nk - 1)):",
      "or not window_covers(r, i0 + 1, i0 + nv - 1, j0, j0 + nk - 1)):",
      BWD_CAUSAL, "backward causal mask-skip boundary one row late"),
    # --- CUDA (simulator)
    M("cuda_causal_off_by_one", CF,
      "if test and not keeps(rc, bs, h, i, j0 + j):",
      "if test and not keeps(rc, bs, h, i - 1, j0 + j):",
      CUDA_FWD, "CUDA forward: the per-element window/causal test one row off"),
    M("cuda_keys_seen_short", "sdpa_numba/gpu/work.py",
      "j_begin, j_end = key_range(rc, i0, i_last, S)",
      "j_begin, j_end = key_range(rc, i0, i_last - 1, S)",
      CUDA_FWD, "CUDA forward: causal key blocks stop one key early"),
    M("cuda_alpha", "sdpa_numba/gpu/online_softmax.py",
      "return m_new, alpha * l + total, alpha",
      "return m_new, l + total, alpha",
      CUDA_FWD, "CUDA online softmax: the running sum not rescaled"),
    M("cuda_lse_offset", "sdpa_numba/gpu/online_softmax.py",
      "return m + math.log(l)  # NaN",
      "return m + math.log(l) + 1e-4  # NaN",
      CUDA_FWD, "CUDA lse off by 1e-4"),
    M("cuda_mask_block_relative", CF,
      "s = masked(s, mask, b, h, q0 + i, k0 + j0 + j, neg_inf)",
      "s = masked(s, mask, b, h, q0 + i, k0 + j, neg_inf)",
      CUDA_FWD, "CUDA forward: mask read at the block-relative key column"),
    M("cuda_dropout_row_key", "sdpa_numba/gpu/dropout.py",
      "return numba.uint64(stream_step(numba.uint64(head_key(seed, b, h)), i))",
      "return numba.uint64(stream_step(numba.uint64(head_key(seed, b, h)), i + 1))",
      CUDA_DROP, "CUDA dropout: the next row's bits"),
    M("cuda_bwd_causal_qb0", CB,
      "i_begin, i_end = query_range(rc, j0, j0 + nj - 1, L)",
      "i_begin, i_end = query_range(rc, j0 + 1, j0 + nj - 1, L)",
      CUDA_BWD, "CUDA backward dK/dV: causal skips one query block too many"),
    # The hardening fixes (issue 14), each undone.
    M("byte_strides_rounded", F,
      "if src.strides[1] == src.itemsize and src.strides[0] % src.itemsize == 0:",
      "if src.strides[1] == src.itemsize:",
      HARD_STRIDES, "rows whose stride is not a multiple of the item size read as if it were"),
    M("v_tiles_past_the_end", F,
      "v_in_place = ldv > 0 and nj == BN and ev_pad - ev <= (s_len - j0 - BN) * ldv",
      "v_in_place = ldv > 0 and nj == BN and j0 + BN < s_len",
      GUARD, "V read in place although the tiles' padding columns pass its end"),
    M("avx2_pv_fold_drops_last_row", "sdpa_numba/cpu/microkernel.py",
      "                for r in range(mr):\n"
      "                    mul_add(ptr_add(acc, r * width), alpha, ptr_add(c, r * ldc))",
      "                for r in range(mr - 1):\n"
      "                    mul_add(ptr_add(acc, r * width), alpha, ptr_add(c, r * ldc))",
      NARROW, "AVX2 tiles: P·V's running output of a tile's last row dropped at each block"),
    M("no_outer_fold", F,
      "folds = s_len > fold_every * BN",
      "folds = False",
      HARD_LONG, "long sequences: no second level of float32 sums"),
    # The score seam (issue 15): each variant's formula, once for every kernel.
    M("window_left_off_by_one", R,
      "return j >= ii - r.left and j <= ii + r.right",
      "return j > ii - r.left and j <= ii + r.right",
      CUDA_VAR, "window: a row misses the key at exactly i' - left"),
    M("window_query_range", R,
      "i_end = min(j_last - r.offset + r.left + 1, l_len)",
      "i_end = min(j_last - r.offset + r.left, l_len)",
      VAR_WINDOW, "window: the last row that sees a key (the forward's per-lane bound) one short"),
    M("window_key_range_left", R,
      "j_begin = max(i_first + r.offset - r.left, 0)",
      "j_begin = max(i_first + r.offset - r.left + 1, 0)",
      VAR_WINDOW, "window work list: the first visible key block starts one key late"),
    M("chunk_rule_off_by_one", R,
      "if r.chunk > 0 and ii // r.chunk != j // r.chunk:",
      "if r.chunk > 0 and (ii + 1) // r.chunk != j // r.chunk:",
      CHUNK_ELEMENTS, "chunked attention: a query's chunk shifted one position (the element "
      "test)"),
    M("chunk_key_range_unskipped", R,
      "j_begin = max(j_begin, (i_first + r.offset) // r.chunk * r.chunk)",
      "j_begin = max(j_begin, 0)",
      CHUNKS, "chunked attention: key blocks before a row block's chunk visited, not skipped"),
    M("bottom_right_offset", "sdpa_numba/problem/variants.py",
      'offset = S - L if alignment == "bottom_right" else 0',
      'offset = S - L - 1 if alignment == "bottom_right" else 0',
      VAR_WINDOW, "bottom-right alignment one key short"),
    M("alibi_sign", R,
      "return lambda r, s, b, h, i, j: s - cast(",
      "return lambda r, s, b, h, i, j: s + cast(",
      VAR_FWD, "ALiBi adds the distance penalty instead of subtracting it"),
    M("sink_not_in_denominator", R,
      "return m_new, alpha * l + math.exp(sink - m_new), alpha",
      "return m_new, alpha * l, alpha",
      VAR_FWD, "sinks: the sink's exp is left out of the row's sum"),
    M("softcap_slope_sign", B,
      "gt[t] = one - th * th",
      "gt[t] = one + th * th",
      VAR_BWD, "soft cap backward: the derivative of tanh with the wrong sign"),
    # Serving: the decode kernel's window, left padding and sinks, and the merge's weights.
    M("decode_causal_off_by_one", "sdpa_numba/cpu/decode.py",
      "i = i0 + rr % lq\n            for j in range(n):\n"
      "                if not in_window",
      "i = i0 + rr % lq + 1\n            for j in range(n):\n"
      "                if not in_window",
      KV, "decode: token t's window (causal: its last key) one position too far"),
    M("decode_reads_before_window", "sdpa_numba/problem/kvcache.py",
      "lo[b] = max(j_begin, first_key(kv_begin, b))",
      "lo[b] = max(j_begin - 1, first_key(kv_begin, b))",
      KV, "decode: one key before the window is read (masked, but not skipped)"),
    M("decode_leftpad_ignored", "sdpa_numba/problem/kvcache.py",
      "lo[b] = max(j_begin, first_key(kv_begin, b))",
      "lo[b] = j_begin",
      KV, "decode: cache_leftpad's keys are read and attended"),
    M("decode_sink_left_out", "sdpa_numba/cpu/merge.py",
      "        total += merge_weight(sink, m)",
      "        total += 0.0 * merge_weight(sink, m)",
      KV, "decode: the sink is left out of the rows' denominators"),
    M("decode_chunk_merge_drops_last", "sdpa_numba/cpu/decode.py",
      "    for c in range(n_b):\n        wc = w[c]\n",
      "    for c in range(n_b - 1):\n        wc = w[c]\n",
      KV, "decode: split-KV's merge leaves a sequence's last chunk out of its rows"),
    M("merge_weight_unshifted", "sdpa_numba/score/merge.py",
      "    return math.exp(lse - m)\n",
      "    return math.exp(lse - m) * (1.0 + (lse != m))\n",
      MERGE, "merge: the smaller part's weight doubled"),
]


def check_list(mutants, root):
    """Every mutant's ``old`` text occurs exactly once in its file; names are unique."""
    problems = []
    names = [m.name for m in mutants]
    for n in set(names):
        if names.count(n) > 1:
            problems.append(f"{n}: name used {names.count(n)} times")
    for m in mutants:
        text = (root / m.path).read_text()
        count = text.count(m.old)
        if count != 1:
            problems.append(f"{m.name}: old text found {count} times in {m.path}: {m.old!r}")
        if m.old == m.new:
            problems.append(f"{m.name}: old and new are the same")
    return problems


def _ignore(directory, names):
    skip = {".git", "__pycache__", ".hypothesis", ".pytest_cache", ".venv", "site", "build",
            "dist", ".benchmarks", "results", "env", "html"}
    return [n for n in names if n in skip or n.endswith((".nbi", ".nbc", ".pyc"))]


def run_one(m, timeout, root):
    """Apply mutant ``m`` (no path: the unmutated tree) in a scratch copy and run its tests.

    Returns ``(status, seconds, detail)``; status is "caught", "missed" or "timeout".
    """
    start = time.monotonic()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="sdpa_mut_"))
    try:
        tree = scratch / "repo"
        shutil.copytree(root, tree, ignore=_ignore, symlinks=True)
        tests = m.tests
        if m.path:  # else: the baseline, unmutated
            f = tree / m.path
            text = f.read_text()
            assert text.count(m.old) == 1, m.name
            f.write_text(text.replace(m.old, m.new))
        cache = scratch / "numba_cache"
        cache.mkdir()
        env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(tree),
               "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("NUMBA_ENABLE_CUDASIM", None)  # tests/cuda's conftest sets it itself
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "--hypothesis-seed=0", *tests]
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", time.monotonic() - start, ""
        out = proc.stdout + proc.stderr
        failed = [ln.split(" - ")[0].replace("FAILED ", "").replace("ERROR ", "")
                  for ln in out.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
        detail = failed[0] if failed else out.strip().splitlines()[-1] if out.strip() else ""
        if proc.returncode == 5:  # nothing collected: the selection is wrong
            return "no tests", time.monotonic() - start, detail
        status = "caught" if proc.returncode != 0 else "missed"
        return status, time.monotonic() - start, detail
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only this mutant (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds per mutant before it counts as a timeout (default 900)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--baseline", action="store_true",
                    help="first run each mutant's tests on the unmutated tree (must pass)")
    args = ap.parse_args(argv)

    problems = check_list(MUTANTS, ROOT)
    if problems:
        print("MUTANT LIST OUT OF STEP WITH THE CODE:", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        return 2
    mutants = MUTANTS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTANTS}
        if unknown:
            ap.error(f"unknown mutant(s): {', '.join(sorted(unknown))}")
        mutants = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:30} {m.path:35} {m.description}")
        return 0

    t0 = time.monotonic()
    if args.baseline:
        selections = {m.tests for m in mutants}
        for sel in sorted(selections):
            base = Mutant("baseline", "", "", "", sel, "the unmutated tree")
            status, secs, detail = run_one(base, args.timeout, ROOT)
            print(f"baseline {' '.join(sel)}: {'ok' if status == 'missed' else status} "
                  f"({secs:.0f} s) {detail}", flush=True)
            if status != "missed":
                print("the unmutated tree fails its tests: fix that first", file=sys.stderr)
                return 1

    def one(m):
        status, secs, detail = run_one(m, args.timeout, ROOT)
        print(f"  {m.name:30} {status:8} {secs:6.0f} s  {detail}", flush=True)
        return m, status, secs, detail

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, mutants))
    total = time.monotonic() - t0

    print()
    print(f"{'mutant':30} {'result':8} {'time':>6}  caught by / description")
    for m, status, secs, detail in results:
        print(f"{m.name:30} {status:8} {secs:5.0f}s  {detail if status == 'caught' else ''}"
              f"{'' if status == 'caught' else m.description}")
    caught = sum(r[1] == "caught" for r in results)
    print(f"\n{caught}/{len(results)} caught; total {total:.0f} s ({total / 60:.1f} min)")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
