#!/usr/bin/env python
"""Test and time sdpa_numba's CUDA path on a real NVIDIA GPU, in one go (under 5 minutes).

1. Runs tests/cuda on the GPU (pytest with SDPA_NUMBA_REAL_GPU=1, not the simulator). Among
   them, two things only a GPU shows: a score_mod / mask_mod that can raise is refused before
   the launch (test_cuda_raising.py; the simulator runs it as Python), and the issue's
   overflowing q · scale example gives 1.0 under the device's fastmath
   (test_cuda_scale_overflow.py).
2. Times the forward against torch's scaled_dot_product_attention on the same GPU: float32
   and float16, B=4 H=16 L=S=4096, head dim 64 and 128, causal and not. Each figure is the
   median of many runs after warm-up (the first call compiles), timed with CUDA events;
   TFLOP/s counts 4·B·H·L·S·D flops, half that when causal.
3. Times the backward on the same problems against torch's autograd backward of its SDPA
   (``torch.autograd.grad`` on a retained graph: the backward kernels only), given the
   forward's output and log-sum-exp; TFLOP/s counts 8·B·H·L·S·D flops (the four L x S x D
   products dV, dP, dQ, dK; recomputing S is not counted), half that when causal: the
   convention of the CPU benchmark (tests/benchmarks/test_bench_backward.py). The gradients
   are checked against torch's.
4. Times two variants (issue 15) forward and backward against torch's FlexAttention
   (``flex_attention`` under ``torch.compile``, the same score_mod / block mask) and, for the
   window, torch's SDPA given the equivalent dense bool mask: a soft cap (``softcap=20``, the
   peer's score_mod ``20 tanh(s / 20)``) and a causal sliding window of 256 keys
   (``is_causal=True, window=(256, 0)``; the peer's block mask from the same rule). TFLOP/s
   count the visited work: the window's ``B·H·Σ_i min(i + 1, 257)·D·4`` flops (8 for the
   backward). Outputs and gradients are checked against the peer's.
5. Times decode (issue 16): ``attention_with_kvcache`` with one query token against full
   contiguous and paged (16-key pages, shuffled) caches, MHA B1 H32 S8192 and GQA Hq32 H8 at
   B1 S16384 and B16 S8192, D128, float16 and float32, against torch's SDPA on the cache in
   its own layout and FlashAttention's ``flash_attn_with_kvcache`` (float16) if installed.
   Reported as K+V bytes per second and as a share of the device's streaming read (torch's
   sum of 1 GiB). ``--skip-decode`` leaves it out.
   Then quantized caches (issue 29): int8 (per-token scales), q8_0 and fp8 e4m3fn caches of
   the same tokens with float16 queries, MHA and GQA contiguous, against our float16 cache
   and FlashAttention 3's fp8 ``flash_attn_with_kvcache`` (``q/k/v_descale``, if installed),
   each checked against the CPU's result on the same quantized cache.
6. Times varlen (issue 16): ``varlen_attention`` and its backward, causal, on a packed batch of
   many short sequences (1000 of 16 to 256 tokens, H16 D128) and of a few long ones (32 of
   1 to 2048), float16 and float32: one launch per kernel for the whole batch, against the
   same call made once per sequence (the launches a per-sequence loop costs), torch's SDPA
   on the batch padded to the longest sequence with a bool mask (causal and padding), and
   FlashAttention's ``flash_attn_varlen_func`` (float16) if installed. TFLOP/s count the
   causal work of each sequence, ``Σ_b 2·H·L_b²·D`` (twice that for the backward).
   ``--skip-varlen`` leaves it out.
7. Times shared-prefix decode (issue 31): B16 requests sharing a 4096-token prefix, each with
   256 tokens of its own, Hq32 H8 D128, one decode step, float16 and float32, pages of 16
   and 64 keys: ``cascade_attention`` (the prefix one contiguous copy, the suffixes paged)
   against 16 independent paged ``attention_with_kvcache`` calls over each request's full
   cache (prefix + suffix) and one batched paged call whose block tables share the prefix's
   pages (scripts/bench_cascade.py's comparison, on the device). Reported as ms, GB/s of the
   K+V bytes each must read (cascade: the prefix once), their share of the streaming read,
   the speedup over the per-request calls and the largest difference from the CPU kernel's
   result of the same call, then whether issue 31's targets (cascade >= 8x per-request and
   >= 80% of the read bandwidth, float16) are met. ``--skip-cascade`` leaves it out.

Usage::

    python scripts/gpu_check.py            # tests, then the full table
    python scripts/gpu_check.py --quick    # smaller problems, fewer runs
    python scripts/gpu_check.py --only-variants  # the soft cap and window against flex
    python scripts/gpu_check.py --only-varlen    # packed batches: one launch vs one per sequence
    python scripts/gpu_check.py --only-cascade   # shared-prefix decode: cascade vs paged calls
    python scripts/gpu_check.py --simulate # no GPU: the same logic on Numba's CUDA simulator,
                                           # tiny sizes (checks the script, times nothing real)

Exit status: 0 when the tests passed and every timed result (output and gradients) matched
torch (quantized decode and the cascade: the CPU kernel's result of the same call), 1 otherwise,
2 when there is no GPU to run on.
"""

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 280  # stop starting new timings past this, to stay under 5 minutes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller problems, fewer runs")
    ap.add_argument("--simulate", action="store_true",
                    help="run on Numba's CUDA simulator with tiny sizes (no GPU needed)")
    ap.add_argument("--skip-tests", action="store_true", help="only time")
    ap.add_argument("--skip-bench", action="store_true", help="only test")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per figure")
    ap.add_argument("--skip-decode", action="store_true",
                    help="skip the KV-cache decode timings")
    ap.add_argument("--skip-varlen", action="store_true",
                    help="skip the varlen (packed batch) timings")
    ap.add_argument("--only-varlen", action="store_true",
                    help="time only varlen (implies --skip-tests)")
    ap.add_argument("--skip-cascade", action="store_true",
                    help="skip the shared-prefix (cascade) decode timings")
    ap.add_argument("--only-cascade", action="store_true",
                    help="time only the cascade (implies --skip-tests)")
    ap.add_argument("--skip-variants", action="store_true",
                    help="do not time the variants (soft cap, sliding window)")
    ap.add_argument("--only-variants", action="store_true",
                    help="time only the variants (implies --skip-tests)")
    return ap.parse_args(argv)


def gpu_available():
    """(True, name) on a usable GPU; (False, why) otherwise. Imports numba.cuda."""
    try:
        from numba import cuda
    except ImportError as exc:
        return False, f"numba-cuda is not installed ({exc}); pip install 'sdpa_numba[cuda]'"
    try:
        if not cuda.is_available():
            return False, "numba.cuda.is_available() is False (no NVIDIA GPU or driver)"
        return True, cuda.get_current_device().name
    except Exception as exc:  # a broken driver or toolkit: say so, don't crash
        return False, f"CUDA is not usable: {exc}"


def run_tests(simulate):
    """pytest on tests/cuda, on the GPU (or the simulator); returns (passed, seconds)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if simulate:
        env.pop("SDPA_NUMBA_REAL_GPU", None)
    else:
        env["SDPA_NUMBA_REAL_GPU"] = "1"
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    cmd = [sys.executable, "-m", "pytest", os.path.join(ROOT, "tests", "cuda"), "-q", "-x",
           "-p", "no:cacheprovider"]
    print("$", " ".join(cmd), "(SDPA_NUMBA_REAL_GPU=1)" if not simulate else "(simulator)",
          flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT)
    return done.returncode == 0, time.perf_counter() - t0


def configs(args):
    """(dtype name, B, H, L, D, causal) of each timed problem."""
    if args.simulate:
        shapes = [(1, 1, 7, 4)]  # checks the script's logic only: tiny
    elif args.quick:
        shapes = [(1, 8, 1024, 64), (1, 8, 1024, 128)]
    else:
        shapes = [(4, 16, 4096, 64), (4, 16, 4096, 128)]
    dtypes = ["float32", "float16"]
    try:
        import ml_dtypes  # noqa: F401  (bfloat16 NumPy arrays: the bf16 extra)

        dtypes.append("bfloat16")
    except ImportError:
        print("ml_dtypes not installed: bfloat16 not checked", flush=True)
    return [(dt, B, H, L, D, causal) for dt in dtypes
            for (B, H, L, D) in shapes for causal in (False, True)]


class Device:
    """Inputs and timing on the GPU (torch tensors, CUDA events) or, with ``--simulate``, on
    the simulator (its arrays for sdpa_numba, CPU tensors for torch, wall-clock time)."""

    def __init__(self, simulate):
        self.simulate = simulate
        try:
            import torch
        except ImportError:
            torch = None
        self.torch = torch
        if not simulate and torch is not None and not torch.cuda.is_available():
            print("torch has no CUDA here: timing sdpa_numba alone", flush=True)
            self.torch = None

    def put(self, x):
        """Host array ``x`` on the device: ``(ours, peer)``, peer None without torch."""
        from numba import cuda

        peer = None
        if self.torch is not None:  # torch.from_numpy has no bfloat16: the same bits as int16
            bf16 = x.dtype.name == "bfloat16"
            peer = self.torch.from_numpy(x.view("int16") if bf16 else x)
            peer = peer.view(self.torch.bfloat16) if bf16 else peer
        if self.simulate or self.torch is None:
            return cuda.to_device(x), peer
        t = peer.cuda()
        return t, t

    def inputs(self, dtype, B, H, L, D, seed=0):
        """``([q, k, v, out buffer], [q, k, v] for torch or None)``; standard normal."""
        import numpy as np

        dtype = np_dtype(dtype)
        rng = np.random.default_rng(seed)
        pairs = [self.put(rng.standard_normal((B, H, L, D)).astype(dtype)) for _ in range(3)]
        ours = [o for o, _ in pairs]
        ours.append(self.put(np.empty((B, H, L, D), dtype))[0])
        return ours, (None if self.torch is None else [t for _, t in pairs])

    def sync(self):
        from numba import cuda

        cuda.synchronize()
        if self.torch is not None and not self.simulate:
            self.torch.cuda.synchronize()

    def time(self, fn, warmup, runs):
        """Median seconds of ``fn()`` over ``runs`` runs after ``warmup`` runs (none on the
        simulator: nothing is compiled for its kernels and its times mean nothing, while each
        run of a kernel costs seconds of Python)."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        events = (self.torch is not None and not self.simulate
                  and self.torch.cuda.current_stream().cuda_stream == 0)
        for _ in range(runs):
            if events:  # numba launches on the legacy default stream: the events bracket it
                start = self.torch.cuda.Event(enable_timing=True)
                end = self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                self.sync()
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]

    def to_numpy(self, x):
        if hasattr(x, "copy_to_host"):
            return x.copy_to_host()
        return x.detach().float().cpu().numpy()


def np_dtype(name):
    """The NumPy dtype of a dtype name (bfloat16: ml_dtypes')."""
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def rel_err(got, want):
    import numpy as np

    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


#: Relative Frobenius error allowed against torch: forward output, and gradients.
FORWARD_TOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2}
BACKWARD_TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


def bench(args, started):
    import numpy as np

    import sdpa_numba

    if args.simulate:
        from sdpa_numba.gpu import Blocks, options

        options.BLOCKS = Blocks(4, 4, 4, 2)  # tiny blocks: the simulator runs a thread each
    dev = Device(args.simulate)
    runs = args.runs or (2 if args.simulate else 5 if args.quick else 20)
    warmup = 0 if args.simulate else 3
    rows, back_rows, ok = [], [], True
    sdpa = sdpa_numba.scaled_dot_product_attention
    sdpa_backward = sdpa_numba.scaled_dot_product_attention_backward
    for dtype, B, H, L, D, causal in configs(args):
        if time.perf_counter() - started > BUDGET_S:
            print(f"time budget spent: skipping {dtype} D={D} causal={causal}", flush=True)
            continue
        (q, k, v, out), peer = dev.inputs(dtype, B, H, L, D)
        flops = 4 * B * H * L * L * D / (2 if causal else 1)
        t0 = time.perf_counter()

        def ours():
            sdpa(q, k, v, is_causal=causal, out=out)

        t_ours = dev.time(ours, warmup, runs)
        t_peer = err = None
        if dev.torch is not None:
            torch_sdpa = dev.torch.nn.functional.scaled_dot_product_attention

            def theirs():
                return torch_sdpa(*peer, is_causal=causal)

            t_peer = dev.time(theirs, warmup, runs)
            err = rel_err(dev.to_numpy(out), dev.to_numpy(theirs()))
            ok &= err <= FORWARD_TOL[dtype]
        rows.append((dtype, B, H, L, D, causal, t_ours, flops, t_peer, err))

        # The backward, given the forward's output and lse, against torch's autograd backward
        # (retained graph: only the backward kernels are timed).
        g, g_peer = dev.put(np.random.default_rng(1).standard_normal((B, H, L, D))
                            .astype(np_dtype(dtype)))
        o, lse = sdpa(q, k, v, is_causal=causal, return_lse=True)
        grads = []

        def ours_backward():
            grads[:] = sdpa_backward(g, q, k, v, o, lse, is_causal=causal)

        t_ours_b = dev.time(ours_backward, warmup, runs)
        t_peer_b = err_b = None
        if dev.torch is not None:
            leaves = [x.detach().clone().requires_grad_() for x in peer]
            out_peer = torch_sdpa(*leaves, is_causal=causal)

            def theirs_backward():
                return dev.torch.autograd.grad(out_peer, leaves, g_peer, retain_graph=True)

            t_peer_b = dev.time(theirs_backward, warmup, runs)
            err_b = max(rel_err(dev.to_numpy(a), dev.to_numpy(b))
                        for a, b in zip(grads, theirs_backward()))
            ok &= err_b <= BACKWARD_TOL[dtype]
        back_rows.append((dtype, B, H, L, D, causal, t_ours_b, 2 * flops, t_peer_b, err_b))
        print(f"  timed {dtype} B={B} H={H} L={L} D={D} causal={causal} (forward, backward) "
              f"in {time.perf_counter() - t0:.1f}s", flush=True)
    print_table("Forward", rows, args.simulate,
                "TFLOP/s: 4*B*H*L*S*D flops, half when causal.")
    print_table("Backward (given out and lse; torch: autograd.grad of its SDPA)", back_rows,
                args.simulate, "TFLOP/s: 8*B*H*L*S*D flops (dV, dP, dQ, dK), half when causal; "
                "rel err: the largest of dQ, dK, dV's.")
    return ok


def variant_configs(args):
    """(variant, dtype name, B, H, L, D, window) of each timed variant problem."""
    if args.simulate:
        shapes, window = [(1, 1, 7, 4)], 2
    elif args.quick:
        shapes, window = [(1, 8, 2048, 64)], 256
    else:
        shapes, window = [(1, 8, 2048, 64), (4, 16, 4096, 64)], 256
    return [(variant, dt, B, H, L, D, window) for variant in ("softcap", "window")
            for dt in ("float32", "float16") for (B, H, L, D) in shapes]


def window_flops(B, H, L, D, window):
    """The forward's visited flops of a causal sliding window: row i sees min(i + 1, W + 1)
    keys."""
    keys = sum(min(i + 1, window + 1) for i in range(L))
    return 4 * B * H * keys * D


def bench_variants(args, started, dev):
    """Forward and backward of the soft cap and the causal sliding window against torch's
    flex_attention (compiled on the GPU; eager on the simulator's CPU) and, for the window,
    torch's SDPA with the dense bool mask. Returns (ok, forward rows, backward rows)."""
    import numpy as np

    import sdpa_numba

    CAP = 20.0
    runs = args.runs or (1 if args.simulate else 5 if args.quick else 20)
    warmup = 0 if args.simulate else 3
    sdpa = sdpa_numba.scaled_dot_product_attention
    sdpa_backward = sdpa_numba.scaled_dot_product_attention_backward
    torch = dev.torch
    flex = create_block_mask = None
    if torch is not None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            flex = flex_attention if args.simulate else torch.compile(flex_attention)
        except ImportError as exc:
            print(f"torch has no flex_attention ({exc}): timing sdpa_numba alone", flush=True)
    rows, back_rows, ok = [], [], True
    for variant, dtype, B, H, L, D, W in variant_configs(args):
        if time.perf_counter() - started > BUDGET_S:
            print(f"time budget spent: skipping {variant} {dtype} L={L}", flush=True)
            continue
        (q, k, v, out), peer = dev.inputs(dtype, B, H, L, D)
        if variant == "softcap":
            kw = dict(softcap=CAP)
            flops = 4 * B * H * L * L * D

            def score_mod(score, b, h, i, j):
                return CAP * torch.tanh(score / CAP)
            peer_kw = dict(score_mod=score_mod)
        else:
            kw = dict(is_causal=True, window=(W, 0))
            flops = window_flops(B, H, L, D, W)
            peer_kw = {}
            if flex is not None:
                def in_window(b, h, i, j):
                    return (j <= i) & (i - j <= W)
                peer_kw = dict(block_mask=create_block_mask(
                    in_window, None, None, L, L, device="cpu" if args.simulate else "cuda"))
        t0 = time.perf_counter()

        def ours():
            sdpa(q, k, v, out=out, **kw)

        t_ours = dev.time(ours, warmup, runs)
        t_flex = t_masked = err = None
        if flex is not None:
            def theirs():
                return flex(*peer, **peer_kw)

            t_flex = dev.time(theirs, warmup, runs)
            err = rel_err(dev.to_numpy(out), dev.to_numpy(theirs()))
            ok &= err <= FORWARD_TOL[dtype]
            if variant == "window":
                i = torch.arange(L, device=peer[0].device)
                dense = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= W)

                def masked():
                    return torch.nn.functional.scaled_dot_product_attention(
                        *peer, attn_mask=dense)

                t_masked = dev.time(masked, warmup, runs)
        rows.append((variant, dtype, B, H, L, D, t_ours, flops, t_flex, t_masked, err))

        g, g_peer = dev.put(np.random.default_rng(1).standard_normal((B, H, L, D))
                            .astype(np_dtype(dtype)))
        o, lse = sdpa(q, k, v, return_lse=True, **kw)
        grads = []

        def ours_backward():
            grads[:] = sdpa_backward(g, q, k, v, o, lse, **kw)

        t_ours_b = dev.time(ours_backward, warmup, runs)
        t_flex_b = err_b = None
        if flex is not None and not args.simulate:  # eager flex has no backward on the CPU
            leaves = [x.detach().clone().requires_grad_() for x in peer]
            out_peer = flex(*leaves, **peer_kw)

            def theirs_backward():
                return torch.autograd.grad(out_peer, leaves, g_peer, retain_graph=True)

            t_flex_b = dev.time(theirs_backward, warmup, runs)
            err_b = max(rel_err(dev.to_numpy(a), dev.to_numpy(b))
                        for a, b in zip(grads, theirs_backward()))
            ok &= err_b <= BACKWARD_TOL[dtype]
        back_rows.append((variant, dtype, B, H, L, D, t_ours_b, 2 * flops, t_flex_b, None,
                          err_b))
        print(f"  timed {variant} {dtype} B={B} H={H} L={L} D={D} (forward, backward) in "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
    return ok, rows, back_rows


def decode_configs(args):
    """(label, dtype name, B, Hq, H, S, D, page size or 0) of each timed decode problem: the
    CPU presets' MHA and GQA shapes (issue 16), a batch big enough to fill the GPU, and each
    with a paged cache of 16-key pages (shuffled)."""
    if args.simulate:
        shapes = [("MHA", 1, 2, 2, 37, 4), ("GQA", 1, 4, 2, 37, 4)]
        pages = (0, 4)
    elif args.quick:
        shapes = [("MHA", 1, 32, 32, 4096, 128), ("GQA", 1, 32, 8, 4096, 128)]
        pages = (0, 16)
    else:
        shapes = [("MHA", 1, 32, 32, 8192, 128), ("GQA", 1, 32, 8, 16384, 128),
                  ("GQA", 16, 32, 8, 8192, 128)]
        pages = (0, 16)
    return [(label, dtype, B, Hq, H, S, D, page) for dtype in ("float16", "float32")
            for label, B, Hq, H, S, D in shapes for page in pages]


def read_bandwidth(dev, simulate):
    """Bytes per second of a streaming read on the device: torch's sum of 1 GiB of float32
    (None without torch or on the simulator)."""
    if simulate or dev.torch is None:
        return None
    x = dev.torch.ones(1 << 28, dtype=dev.torch.float32, device="cuda")
    return x.numel() * 4 / dev.time(lambda: x.sum(), 3, 20)


def flash_attn(name):
    """FlashAttention's function ``name`` (from FlashAttention 3, else 2), or None if it is not
    installed."""
    for module in ("flash_attn_interface", "flash_attn"):
        try:
            return getattr(__import__(module), name)
        except (ImportError, AttributeError):
            continue
    return None


def bench_decode(args, started, dev):
    """Decode (one new query token per sequence against a full cache) with
    ``attention_with_kvcache`` on contiguous and paged caches, against torch's SDPA on the
    cache in its own layout ``(B, H, S, D)`` (GQA by ``enable_gqa``) and FlashAttention's
    ``flash_attn_with_kvcache`` (float16, if installed). Each time is reported as the K+V
    bytes per second and as a share of the device's streaming read. Outputs are checked
    against torch's. Returns ``(ok, rows, read bytes/s)``."""
    import numpy as np

    import sdpa_numba

    runs = args.runs or (1 if args.simulate else 5 if args.quick else 20)
    warmup = 0 if args.simulate else 3
    read = read_bandwidth(dev, args.simulate)
    fa = None if args.simulate else flash_attn("flash_attn_with_kvcache")
    rows, ok = [], True
    for label, dtype, B, Hq, H, S, D, page in decode_configs(args):
        if time.perf_counter() - started > BUDGET_S:
            print(f"time budget spent: skipping decode {label} {dtype} page {page}", flush=True)
            continue
        rng = np.random.default_rng(2)
        dt = np_dtype(dtype)
        q_h = rng.standard_normal((B, 1, Hq, D)).astype(dt)
        k_h, v_h = (rng.standard_normal((B, S, H, D)).astype(dt) for _ in range(2))
        seqlens = np.full(B, S, np.int32)
        table = None
        if page:  # the same keys in shuffled pages of ``page`` keys
            n = -(-S // page)  # the last page partly used
            perm = rng.permutation(B * n)
            table = perm.reshape(B, n).astype(np.int32)
            kp, vp = (np.zeros((B * n, page, H, D), dt) for _ in range(2))
            pad = ((0, 0), (0, n * page - S), (0, 0), (0, 0))
            kp[perm] = np.pad(k_h, pad).reshape(B * n, page, H, D)
            vp[perm] = np.pad(v_h, pad).reshape(B * n, page, H, D)
            kc, vc = dev.put(kp)[0], dev.put(vp)[0]
        else:
            kc, vc = dev.put(k_h)[0], dev.put(v_h)[0]
        q, q_peer = dev.put(q_h)
        out = dev.put(np.empty_like(q_h))[0]

        def ours():
            sdpa_numba.attention_with_kvcache(q, kc, vc, seqlens, block_table=table, out=out)

        t_ours = dev.time(ours, warmup, runs)
        kv_bytes = 2 * B * S * H * D * dt.itemsize
        t_peer = t_fa = err = None
        if dev.torch is not None:
            torch = dev.torch
            # torch's SDPA layout: (B, H, S, D), contiguous (a copy made once, not timed)
            qt = q_peer.transpose(1, 2)
            kt, vt = (dev.put(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))[1]
                      for x in (k_h, v_h))
            if dtype == "bfloat16" or (args.simulate and dtype == "float16"):
                qt, kt, vt = qt.float(), kt.float(), vt.float()  # CPU torch lacks half kernels

            def theirs():
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, enable_gqa=Hq != H)

            t_peer = dev.time(theirs, warmup, runs)
            err = rel_err(dev.to_numpy(out), dev.to_numpy(theirs().transpose(1, 2)))
            ok &= err <= FORWARD_TOL[dtype]
            if fa is not None and dtype == "float16":
                kf, vf = (dev.put(x)[1] for x in ((kp, vp) if page else (k_h, v_h)))
                tab = None if table is None else torch.from_numpy(table).cuda()
                lens = torch.from_numpy(seqlens).cuda()
                try:  # FlashAttention 2 takes pages of a multiple of 256 keys only
                    t_fa = dev.time(lambda: fa(q_peer, kf, vf, cache_seqlens=lens,
                                               block_table=tab), warmup, runs)
                except Exception as e:  # noqa: BLE001  (a peer's refusal is not our failure)
                    print(f"  flash_attn_with_kvcache refused {label} page {page}: {e}",
                          flush=True)
        rows.append((label, dtype, B, Hq, H, S, D, page, t_ours, kv_bytes, t_peer, t_fa, err))
    print_decode_table(rows, read, args.simulate)
    return ok


def varlen_configs(args):
    """(label, dtype name, number of sequences, shortest, longest, H, D) of each timed varlen
    problem (sequence lengths uniform in [shortest, longest], queries as many as keys)."""
    if args.simulate:
        shapes = [("many", 6, 0, 5, 2, 4)]
    elif args.quick:
        shapes = [("many", 200, 16, 128, 8, 64), ("long", 8, 1, 1024, 8, 64)]
    else:
        shapes = [("many", 1000, 16, 256, 16, 128), ("long", 32, 1, 2048, 16, 128)]
    return [(label, dtype, n, lo, hi, H, D) for dtype in ("float16", "float32")
            for label, n, lo, hi, H, D in shapes]


def bench_varlen(args, started, dev):
    """Causal ``varlen_attention`` (forward, and backward given out and lse) on packed
    batches, against the same call once per sequence, torch's SDPA on the padded batch with a
    bool mask (its autograd backward), and ``flash_attn_varlen_func`` (float16, forward) if
    installed. Outputs and gradients are checked against torch's. Returns ``ok``."""
    import numpy as np

    import sdpa_numba

    runs = args.runs or (1 if args.simulate else 5 if args.quick else 20)
    warmup = 0 if args.simulate else 3
    fa = None if args.simulate else flash_attn("flash_attn_varlen_func")
    rows, back_rows, ok = [], [], True
    for label, dtype, n, lo, hi, H, D in varlen_configs(args):
        if time.perf_counter() - started > BUDGET_S:
            print(f"time budget spent: skipping varlen {label} {dtype}", flush=True)
            continue
        rng = np.random.default_rng(3)
        dt = np_dtype(dtype)
        lengths = rng.integers(lo, hi + 1, n)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        total, longest = int(cu[-1]), int(lengths.max())
        q_h, k_h, v_h, g_h = (rng.standard_normal((total, H, D)).astype(dt) for _ in range(4))
        (q, q_t), (k, k_t), (v, v_t), (g, g_t) = (dev.put(x) for x in (q_h, k_h, v_h, g_h))
        out = dev.put(np.empty_like(q_h))[0]
        flops = sum(2 * H * int(m) * int(m) * D for m in lengths)
        t0 = time.perf_counter()

        def ours():
            sdpa_numba.varlen_attention(q, k, v, cu, cu, is_causal=True, out=out)

        def per_sequence():  # what a call (a launch) per sequence costs
            for b in range(n):
                c0, c1 = int(cu[b]), int(cu[b + 1])
                one = np.array([0, c1 - c0], np.int32)
                sdpa_numba.varlen_attention(q[c0:c1], k[c0:c1], v[c0:c1], one, one,
                                            is_causal=True, out=out[c0:c1])

        t_ours = dev.time(ours, warmup, runs)
        t_loop = dev.time(per_sequence, 1, min(runs, 3))
        o, lse = sdpa_numba.varlen_attention(q, k, v, cu, cu, is_causal=True, return_lse=True)
        grads = []

        def ours_backward():
            grads[:] = sdpa_numba.varlen_attention_backward(g, q, k, v, o, lse, cu, cu,
                                                            is_causal=True)

        t_ours_b = dev.time(ours_backward, warmup, runs)
        t_pad = t_pad_b = t_fa = err = err_b = None
        if dev.torch is not None:
            torch = dev.torch
            cpu_half = args.simulate and dtype != "float32"  # CPU torch lacks half SDPA

            def padded(x):  # (B, H, longest, D), zeros past each sequence
                p = np.zeros((n, longest, H, D), np.float32 if cpu_half else dt)
                for b in range(n):
                    p[b, :lengths[b]] = x[cu[b]:cu[b + 1]]
                return dev.put(np.ascontiguousarray(p.transpose(0, 2, 1, 3)))[1]

            i = np.arange(longest)
            keep = (i[None, :] <= i[:, None])[None] & (i[None, None, :] < lengths[:, None, None])
            keep[:, :, 0] = True  # padding rows see a key (their rows are not compared)
            mask = dev.put(keep[:, None])[1]
            leaves = [padded(x).requires_grad_() for x in (q_h, k_h, v_h)]

            def theirs():
                return torch.nn.functional.scaled_dot_product_attention(*leaves,
                                                                        attn_mask=mask)

            plain = [x.detach() for x in leaves]  # the forward timed without autograd
            t_pad = dev.time(lambda: torch.nn.functional.scaled_dot_product_attention(
                *plain, attn_mask=mask), warmup, runs)
            out_pad = theirs()
            g_pad = padded(g_h)

            def unpad(x):  # (B, H, longest, D) -> packed (total, H, D), float32
                x = dev.to_numpy(x).transpose(0, 2, 1, 3)
                return np.concatenate([x[b, :lengths[b]] for b in range(n)])

            def theirs_backward():
                return torch.autograd.grad(out_pad, leaves, g_pad, retain_graph=True)

            t_pad_b = dev.time(theirs_backward, warmup, runs)
            err = rel_err(dev.to_numpy(out), unpad(out_pad.detach()))
            err_b = max(rel_err(dev.to_numpy(a), unpad(b))
                        for a, b in zip(grads, theirs_backward()))
            ok &= err <= FORWARD_TOL[dtype] and err_b <= BACKWARD_TOL[dtype]
            if fa is not None and dtype == "float16":
                cu_t = torch.from_numpy(cu).cuda()
                try:
                    t_fa = dev.time(lambda: fa(q_t, k_t, v_t, cu_t, cu_t, longest, longest,
                                               causal=True), warmup, runs)
                except Exception as e:  # noqa: BLE001  (a peer's refusal is not our failure)
                    print(f"  flash_attn_varlen_func refused {label}: {e}", flush=True)
        rows.append((label, dtype, n, lo, hi, H, D, t_ours, flops, t_loop, t_pad, t_fa, err))
        back_rows.append((label, dtype, n, lo, hi, H, D, t_ours_b, 2 * flops, None, t_pad_b,
                          None, err_b))
        print(f"  timed varlen {label} {dtype} ({n} sequences, {total} tokens) in "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
    print_varlen_table("Varlen, forward (causal)", rows, args.simulate)
    print_varlen_table("Varlen, backward (given out and lse; torch: autograd.grad of the "
                       "padded SDPA)", back_rows, args.simulate)
    return ok


def print_varlen_table(title, rows, simulate):
    peer = "padded (CPU)" if simulate else "padded"
    head = (f"{'case':4} {'dtype':8} {'seqs':>5} {'lengths':>9} {'H':>3} {'D':>4} | "
            f"{'ours ms':>8} {'TFLOP/s':>8} | {'per seq ms':>10} {'ratio':>7} | "
            f"{peer + ' ms':>15} {'ratio':>7} | {'FA ms':>8} {'ratio':>7} | {'rel err':>8}")
    print_head(title, head)
    for label, dtype, n, lo, hi, H, D, t, flops, t_loop, t_pad, t_fa, err in rows:
        line = (f"{label:4} {dtype:8} {n:>5} {f'{lo}-{hi}':>9} {H:>3} {D:>4} | "
                f"{t * 1e3:>8.3f} {flops / t / 1e12:>8.2f} | ")
        line += peer_cells(t, ((t_loop, 10), (t_pad, 15), (t_fa, 8)))
        line += f"{'n/a':>8}" if err is None else f"{err:>8.1e}"
        print(line)
    print("\nratio = other time / our time (above 1: ours faster). per seq: our call once per "
          "sequence (a launch each); padded: torch's SDPA on the batch padded to the longest "
          "sequence with a causal and padding bool mask; FA: flash_attn_varlen_func (float16). "
          "TFLOP/s: each sequence's causal work.")


def print_head(title, head):
    """A table's title, column heads and rule."""
    print(f"\n{title}")
    print(head)
    print("-" * len(head))

def peer_cells(t, peers):
    """Table cells of each ``(peer time or None, width)`` in ``peers``: its ms and its ratio
    to our time ``t`` (``n/a`` where the peer was not timed)."""
    return "".join(f"{'n/a':>{width}} {'':>7} | " if peer_t is None else
                   f"{peer_t * 1e3:>{width}.3f} {peer_t / t:>6.2f}x | "
                   for peer_t, width in peers)


QUANT_FORMATS = ("int8", "q8_0", "e4m3fn")


def bench_decode_quant(args, started, dev):
    """Decode over quantized caches (issue 29): for each of :data:`QUANT_FORMATS`, the MHA
    and GQA shapes of :func:`decode_configs` (contiguous caches, float16 queries), our time
    against our float16 cache of the same tokens and FlashAttention 3's fp8 kvcache call (fp8
    q, k, v with per (B, H) descales; e4m3fn only, if installed), as bytes read per second.
    Outputs are checked against the CPU kernel on the same host arrays. Returns ok."""
    import numpy as np
    from numba import cuda

    import sdpa_numba
    from sdpa_numba import quantize_kv

    runs = args.runs or (1 if args.simulate else 5 if args.quick else 20)
    warmup = 0 if args.simulate else 3
    read = read_bandwidth(dev, args.simulate)
    fa = None if args.simulate else flash_attn("flash_attn_with_kvcache")
    shapes = sorted({(label, B, Hq, H, S, D) for label, dtype, B, Hq, H, S, D, page
                     in decode_configs(args) if page == 0 and B == 1})
    if args.simulate:  # q8_0 takes head dims that are multiples of 32
        shapes = [(label, B, Hq, H, S, 32) for label, B, Hq, H, S, _ in shapes]
    rows, ok = [], True
    for label, B, Hq, H, S, D in shapes:
        rng = np.random.default_rng(3)
        q_h = rng.standard_normal((B, 1, Hq, D)).astype(np.float16)
        k_h, v_h = (rng.standard_normal((B, S, H, D)).astype(np.float16) for _ in range(2))
        lens = np.full(B, S, np.int32)
        q = cuda.to_device(q_h)
        kf, vf = cuda.to_device(k_h), cuda.to_device(v_h)
        t_f16 = dev.time(lambda: sdpa_numba.attention_with_kvcache(q, kf, vf, lens),
                         warmup, runs)
        for fmt in QUANT_FORMATS:
            if time.perf_counter() - started > BUDGET_S:
                print(f"time budget spent: skipping quantized decode {label} {fmt}", flush=True)
                continue
            kq, ks = quantize_kv(k_h, fmt, per_head=True) if fmt == "e4m3fn" else \
                quantize_kv(k_h, fmt)
            vq, vs = quantize_kv(v_h, fmt, per_head=True) if fmt == "e4m3fn" else \
                quantize_kv(v_h, fmt)
            dk, dv, dks, dvs = (cuda.to_device(x) for x in (kq, vq, ks, vs))
            out = cuda.device_array(q_h.shape, np.float16)

            def ours():
                sdpa_numba.attention_with_kvcache(q, dk, dv, lens, k_scale=dks, v_scale=dvs,
                                                  out=out)

            t = dev.time(ours, warmup, runs)
            # On the simulator (a CI test) the CPU's answer comes from float32 queries (the
            # same values: float16 widens exactly), whose quantized-cache kernel the test suite
            # compiles anyway (tests/test_kvcache_quant.py), not from a float16-query one that
            # only this check would compile (~25 s); the difference is the output's rounding to
            # float16 (~3e-4), well inside the tolerance. On a GPU: the float16 call itself.
            q_cpu = q_h.astype(np.float32) if args.simulate else q_h
            want = sdpa_numba.attention_with_kvcache(q_cpu, kq, vq, lens, k_scale=ks,
                                                     v_scale=vs)
            err = rel_err(out.copy_to_host(), want)
            ok &= err <= FORWARD_TOL["float16"]
            nbytes = kq.nbytes + vq.nbytes + ks.nbytes + vs.nbytes
            t_fa = None
            if fa is not None and fmt == "e4m3fn" and dev.torch is not None:
                torch = dev.torch
                f8 = torch.float8_e4m3fn
                qd = float(np.abs(q_h).max()) / 448
                qt = (torch.from_numpy(q_h).cuda().float() / qd).to(f8)
                kt, vt = (torch.from_numpy(x.view(np.uint8)).cuda().view(f8) for x in (kq, vq))
                desc = [torch.full((B, H), qd, device="cuda"),
                        torch.from_numpy(ks).cuda(), torch.from_numpy(vs).cuda()]
                tl = torch.from_numpy(lens).cuda()
                try:
                    t_fa = dev.time(lambda: fa(qt, kt, vt, cache_seqlens=tl, q_descale=desc[0],
                                               k_descale=desc[1], v_descale=desc[2]),
                                    warmup, runs)
                except Exception as e:  # noqa: BLE001  (a peer's refusal is not our failure)
                    print(f"  FA3 fp8 flash_attn_with_kvcache refused {label}: {e}", flush=True)
            rows.append((label, fmt, B, Hq, H, S, D, t, nbytes, t_f16, t_fa, err))
    print_head("Decode over quantized caches (float16 queries, contiguous caches)",
               f"{'case':4} {'format':7} {'Hq':>3} {'H':>2} {'S':>6} {'D':>4} | {'ours ms':>8} "
               f"{'GB/s':>7} {'% read':>6} | {'f16 cache ms':>12} {'ratio':>7} | "
               f"{'FA3 fp8 ms':>10} {'ratio':>7} | {'rel err':>8}")
    for label, fmt, B, Hq, H, S, D, t, nbytes, t_f16, t_fa, err in rows:
        line = (f"{label:4} {fmt:7} {Hq:>3} {H:>2} {S:>6} {D:>4} | {t * 1e3:>8.3f} "
                f"{nbytes / t / 1e9:>7.1f} "
                f"{'n/a' if read is None else f'{100 * nbytes / t / read:.0f}%':>6} | ")
        line += peer_cells(t, ((t_f16, 12), (t_fa, 10)))
        print(line + f"{err:>8.1e}")
    print("\nGB/s: the quantized K+V bytes and their scales / our time. ratio = the other's "
          "time / ours; rel err against the CPU kernel on the same quantized cache.")
    return ok


def cascade_configs(args):
    """(dtype name, B, prefix P, suffix S, Hq, H, D, page size) of each timed cascade problem:
    issue 31's case (B16 sharing a 4096-token prefix, 256 own tokens each, Hq32 H8 D128),
    pages of 16 and 64 keys."""
    if args.simulate:  # odd suffix (a partly used last page), the prefix a whole number of pages
        shapes, pages = [(3, 8, 5, 4, 2, 4)], (4,)
    elif args.quick:
        shapes, pages = [(16, 2048, 128, 32, 8, 128)], (16,)
    else:
        shapes, pages = [(16, 4096, 256, 32, 8, 128)], (16, 64)
    return [(dtype, *shape, page) for dtype in ("float16", "float32") for shape in shapes
            for page in pages]


def cascade_inputs(rng, dt, B, P, S, Hq, H, D, page):
    """Host arrays of one cascade problem, as :func:`sdpa_numba.cascade_attention` and the
    two paged peers take them (scripts/bench_cascade.py's layouts): ``q``; the prefix
    ``(P, H, D)`` once; the suffixes in shuffled pages and their table; each request's full
    cache (prefix + suffix) in its own shuffled pages and their table; and the batch's pages
    with the prefix's pages once, shared by every request's table (``P % page == 0``)."""
    import numpy as np

    if P % page:  # the shared pages hold the prefix alone
        raise ValueError(f"the prefix ({P} keys) must fill whole pages of {page} keys")

    def paged(x, table):  # x (B, n, H, D) in the pages of ``table`` (B, ceil(n / page))
        n, per = x.shape[1], table.shape[1]
        c = np.zeros((table.size, page, H, D), dt)
        c[table.reshape(-1)] = np.pad(x, ((0, 0), (0, per * page - n), (0, 0), (0, 0))
                                      ).reshape(-1, page, H, D)
        return c

    q = rng.standard_normal((B, 1, Hq, D)).astype(dt)
    pk, pv = (rng.standard_normal((P, H, D)).astype(dt) for _ in range(2))
    sk, sv = (rng.standard_normal((B, S, H, D)).astype(dt) for _ in range(2))
    s_per, f_per = -(-S // page), -(-(P + S) // page)
    s_table = rng.permutation(B * s_per).reshape(B, s_per).astype(np.int32)
    f_table = rng.permutation(B * f_per).reshape(B, f_per).astype(np.int32)
    full_k, full_v = (np.concatenate([np.broadcast_to(p, (B, P, H, D)), s], 1)
                      for p, s in ((pk, sk), (pv, sv)))
    skc, svc = paged(sk, s_table), paged(sv, s_table)
    p_per = P // page
    shared = [np.concatenate([p.reshape(p_per, page, H, D), c]) for p, c in
              ((pk, skc), (pv, svc))]
    sh_table = np.concatenate([np.arange(p_per)[None].repeat(B, 0), p_per + s_table],
                              1).astype(np.int32)
    return dict(q=q, pk=pk, pv=pv, skc=skc, svc=svc, s_table=s_table,
                fkc=paged(full_k, f_table), fvc=paged(full_v, f_table), f_table=f_table,
                shk=shared[0], shv=shared[1], sh_table=sh_table)


def bench_cascade(args, started, dev):
    """Shared-prefix decode (issue 31): :func:`sdpa_numba.cascade_attention` (the prefix one
    contiguous copy, the suffixes paged) against ``B`` independent paged
    ``attention_with_kvcache`` calls over each request's full cache (prefix + suffix) and one
    batched paged call whose tables share the prefix's pages, on the device. Each is reported
    as the bytes it must read per second (cascade: the prefix once and the suffixes; the
    others: the prefix once per request), as a share of the device's streaming read, and as
    its speedup over the per-request calls; each result is checked against the CPU kernel's
    result of the same call on the same host arrays. Returns ``ok``."""
    import numpy as np

    import sdpa_numba

    runs = args.runs or (1 if args.simulate else 5 if args.quick else 20)
    warmup = 0 if args.simulate else 3
    read = read_bandwidth(dev, args.simulate)
    awk, cascade = sdpa_numba.attention_with_kvcache, sdpa_numba.cascade_attention
    rows, ok = [], True
    for dtype, B, P, S, Hq, H, D, page in cascade_configs(args):
        if time.perf_counter() - started > BUDGET_S:
            print(f"time budget spent: skipping cascade {dtype} page {page}", flush=True)
            continue
        t0 = time.perf_counter()
        dt = np_dtype(dtype)
        h = cascade_inputs(np.random.default_rng(4), dt, B, P, S, Hq, H, D, page)
        d = {name: dev.put(x)[0] for name, x in h.items() if not name.endswith("table")}
        s_lens, f_lens = np.full(B, S, np.int32), np.full(B, P + S, np.int32)
        outs = {name: dev.put(np.full_like(h["q"], np.nan))[0]
                for name in ("cascade", "per-request", "batched, shared pages")}
        calls = {  # name: (the device call, the same call on the host arrays)
            "cascade": (
                lambda: cascade(d["q"], d["pk"], d["pv"], d["skc"], d["svc"], s_lens,
                                block_table=h["s_table"], out=outs["cascade"]),
                lambda: cascade(h["q"], h["pk"], h["pv"], h["skc"], h["svc"], s_lens,
                                block_table=h["s_table"])),
            "per-request": (
                lambda: [awk(d["q"][i:i + 1], d["fkc"], d["fvc"], f_lens[i:i + 1],
                             block_table=h["f_table"][i:i + 1],
                             out=outs["per-request"][i:i + 1]) for i in range(B)],
                lambda: np.concatenate([awk(h["q"][i:i + 1], h["fkc"], h["fvc"],
                                            f_lens[i:i + 1], block_table=h["f_table"][i:i + 1])
                                        for i in range(B)])),
            "batched, shared pages": (
                lambda: awk(d["q"], d["shk"], d["shv"], f_lens, block_table=h["sh_table"],
                            out=outs["batched, shared pages"]),
                lambda: awk(h["q"], h["shk"], h["shv"], f_lens, block_table=h["sh_table"])),
        }
        item = dt.itemsize
        nbytes = {"cascade": (P + B * S) * H * 2 * D * item}
        nbytes["per-request"] = nbytes["batched, shared pages"] = B * (P + S) * H * 2 * D * item
        times = {name: dev.time(fn, warmup, runs) for name, (fn, _) in calls.items()}
        for name, (_, on_host) in calls.items():
            got, want = dev.to_numpy(outs[name]), on_host()
            err = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
            ok &= rel_err(got, want) <= FORWARD_TOL[dtype]  # NaN (a row not written) fails
            rows.append((dtype, B, P, S, Hq, H, D, page, name, times[name], nbytes[name],
                         times["per-request"] / times[name], err))
        print(f"  timed cascade {dtype} B={B} P={P} S={S} page {page} in "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
    print_cascade_table(rows, read, args.simulate)
    return ok


def print_cascade_table(rows, read, simulate):
    head = (f"{'dtype':8} {'B':>2} {'P':>5} {'S':>4} {'Hq':>3} {'H':>2} {'D':>4} {'page':>4} "
            f"| {'call':22} | {'ms':>8} {'GB/s':>7} {'% read':>6} | {'vs per-req':>10} | "
            f"{'max |diff| vs CPU':>17}")
    print_head("Cascade: B requests sharing a P-token prefix, S own tokens each, one decode "
               "step (issue 31)", head)
    for dtype, B, P, S, Hq, H, D, page, name, t, nbytes, speedup, err in rows:
        print(f"{dtype:8} {B:>2} {P:>5} {S:>4} {Hq:>3} {H:>2} {D:>4} {page:>4} | {name:22} | "
              f"{t * 1e3:>8.3f} {nbytes / t / 1e9:>7.1f} "
              f"{'n/a' if read is None else f'{100 * nbytes / t / read:.0f}%':>6} | "
              f"{speedup:>9.2f}x | {err:>17.1e}")
    print("\nGB/s: the K+V bytes each must read / its time (cascade: the prefix once and the "
          "suffixes; per-request and batched: the prefix once per request); % read: of the "
          "device's streaming read ("
          + ("not measured on the simulator" if read is None else f"{read / 1e9:.0f} GB/s, "
             "torch.sum of 1 GiB") + "). vs per-req = per-request time / this time. "
          "per-request: B paged attention_with_kvcache calls over each request's prefix + "
          "suffix; batched, shared pages: one paged call whose tables share the prefix's "
          "pages. max |diff|: against the CPU kernel's result of the same call.")
    issue = [r for r in rows if r[0] == "float16" and r[1:7] == (16, 4096, 256, 32, 8, 128)
             and r[8] == "cascade"]
    for r in issue if read is not None else ():
        t, nbytes, speedup = r[9], r[10], r[11]
        print(f"issue 31 (float16, page {r[7]}): cascade {speedup:.1f}x per-request (target "
              f">= 8x: {'met' if speedup >= 8 else 'NOT met'}), "
              f"{100 * nbytes / t / read:.0f}% of the read bandwidth (target >= 80%: "
              f"{'met' if nbytes / t >= 0.8 * read else 'NOT met'})")


def print_decode_table(rows, read, simulate):
    peer = "torch (CPU)" if simulate else "torch"
    head = (f"{'case':4} {'dtype':8} {'B':>2} {'Hq':>3} {'H':>2} {'S':>6} {'D':>4} {'page':>4} | "
            f"{'ours ms':>8} {'GB/s':>7} {'% read':>6} | {peer + ' ms':>11} {'ratio':>7} | "
            f"{'FA ms':>8} {'ratio':>7} | {'rel err':>8}")
    print_head("Decode: one query token against a full cache (attention_with_kvcache)", head)
    for label, dtype, B, Hq, H, S, D, page, t, nbytes, t_peer, t_fa, err in rows:
        line = (f"{label:4} {dtype:8} {B:>2} {Hq:>3} {H:>2} {S:>6} {D:>4} {page or '-':>4} | "
                f"{t * 1e3:>8.3f} {nbytes / t / 1e9:>7.1f} "
                f"{'n/a' if read is None else f'{100 * nbytes / t / read:.0f}%':>6} | ")
        line += peer_cells(t, ((t_peer, 11), (t_fa, 8)))
        line += f"{'n/a':>8}" if err is None else f"{err:>8.1e}"
        print(line)
    print("\nGB/s: K+V bytes / our time; % read: of the device's streaming read ("
          + ("not measured on the simulator" if read is None else f"{read / 1e9:.0f} GB/s, "
             "torch.sum of 1 GiB") + "). ratio = peer time / our time. torch reads its "
          "contiguous (B, H, S, D) copy of the cache; FA (flash_attn_with_kvcache, float16) "
          "reads ours.")


def print_variant_table(title, rows, simulate):
    peer = "flex (CPU, eager)" if simulate else "flex (compiled)"
    head = (f"{'variant':8} {'dtype':8} {'B':>2} {'H':>3} {'L=S':>5} {'D':>4} | "
            f"{'ours ms':>9} {'TFLOP/s':>8} | {peer + ' ms':>20} {'ratio':>7} | "
            f"{'SDPA+mask ms':>12} {'ratio':>7} | {'rel err':>8}")
    print_head(title, head)
    for variant, dtype, B, H, L, D, t_ours, flops, t_flex, t_masked, err in rows:
        line = (f"{variant:8} {dtype:8} {B:>2} {H:>3} {L:>5} {D:>4} | "
                f"{t_ours * 1e3:>9.3f} {flops / t_ours / 1e12:>8.2f} | ")
        line += peer_cells(t_ours, ((t_flex, 20), (t_masked, 12)))
        line += f"{'n/a':>8}" if err is None else f"{err:>8.1e}"
        print(line)
    print("\nratio = peer time / our time (above 1: faster than the peer). TFLOP/s: visited "
          "work (window: keys each row sees).")


def print_table(title, rows, simulate, flops_note):
    peer = "torch (CPU)" if simulate else "torch"
    head = (f"{'dtype':8} {'B':>2} {'H':>3} {'L=S':>5} {'D':>4} {'causal':>6} | "
            f"{'ours ms':>9} {'TFLOP/s':>8} | {peer + ' ms':>11} {'TFLOP/s':>8} | "
            f"{'speed vs torch':>14} {'rel err':>8}")
    print_head(title, head)
    for dtype, B, H, L, D, causal, t_ours, flops, t_peer, err in rows:
        line = (f"{dtype:8} {B:>2} {H:>3} {L:>5} {D:>4} {str(causal):>6} | "
                f"{t_ours * 1e3:>9.3f} {flops / t_ours / 1e12:>8.2f} | ")
        if t_peer is None:
            line += f"{'n/a':>11} {'':>8} | {'':>14} {'':>8}"
        else:
            line += (f"{t_peer * 1e3:>11.3f} {flops / t_peer / 1e12:>8.2f} | "
                     f"{t_peer / t_ours:>13.3f}x {err:>8.1e}")
        print(line)
    print(f"\nspeed vs torch = torch time / our time (above 1: faster than torch). "
          f"{flops_note}")


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    if args.simulate:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba.cuda is imported
    sys.path.insert(0, ROOT)
    if not args.simulate:
        ok, what = gpu_available()
        if not ok:
            print(f"gpu_check: no GPU to run on: {what}.\n"
                  f"Run it on a machine with an NVIDIA GPU, or pass --simulate to exercise "
                  f"this script on Numba's CUDA simulator.", file=sys.stderr)
            return 2
        print(f"GPU: {what}", flush=True)
    passed = True
    if args.only_varlen:
        args.skip_tests = args.skip_variants = args.skip_decode = args.skip_cascade = True
    if args.only_cascade:
        args.skip_tests = args.skip_variants = args.skip_decode = args.skip_varlen = True
    if not args.skip_tests and not args.only_variants:
        passed, seconds = run_tests(args.simulate)
        print(f"tests/cuda {'passed' if passed else 'FAILED'} in {seconds:.0f}s", flush=True)
    matched = True
    if not (args.skip_bench or args.only_variants or args.only_varlen or args.only_cascade):
        matched = bench(args, started)
    if not args.skip_bench and not args.skip_variants:
        if args.simulate:
            from sdpa_numba.gpu import Blocks, options

            options.BLOCKS = Blocks(4, 4, 4, 2)
        ok, rows, back_rows = bench_variants(args, started, Device(args.simulate))
        matched &= ok
        print_variant_table("Variants, forward", rows, args.simulate)
        print_variant_table("Variants, backward (given out and lse; flex: autograd.grad)",
                            back_rows, args.simulate)
    if not args.skip_bench and not args.skip_decode and not args.only_variants:
        matched &= bench_decode(args, started, Device(args.simulate))
        matched &= bench_decode_quant(args, started, Device(args.simulate))
    if not args.skip_bench and not args.skip_varlen and not args.only_variants:
        if args.simulate:
            from sdpa_numba.gpu import Blocks, options

            options.BLOCKS = Blocks(4, 4, 4, 2)
        matched &= bench_varlen(args, started, Device(args.simulate))
    if not args.skip_bench and not args.skip_cascade and not args.only_variants:
        if args.simulate:
            from sdpa_numba.gpu import Blocks, options

            from sdpa_numba.gpu import decode

            options.BLOCKS = Blocks(4, 4, 4, 2)
            decode.THREADS = 32  # the simulator runs each thread in Python (any count works)
        matched &= bench_cascade(args, started, Device(args.simulate))
    if not matched:
        print("some results differ from torch's beyond tolerance", flush=True)
    print(f"\ngpu_check done in {time.perf_counter() - started:.0f}s", flush=True)
    return 0 if passed and matched else 1


if __name__ == "__main__":
    sys.exit(main())
