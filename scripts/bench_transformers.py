#!/usr/bin/env python
"""End to end: a Hugging Face Llama-style model on sdpa_numba against torch's SDPA.

One process, the same random weights for both implementations (two models sharing one state
dict), the same threads. For each implementation, in alternation with a pause before each
timed call (idle spinning thread pools slow the other library's next call on a small machine):

* prefill: one forward of ``--prompt`` tokens (batch 1, no padding: causal);
* generate: ``model.generate`` of ``--new`` tokens after the same prompt (greedy, KV cache,
  ``min_new_tokens`` so that every run makes them all); the decode rate is the new tokens over
  (generate time - prefill time).

Attention's share: transformers' attention functions (``"sdpa"``'s and ``"sdpa_numba"``'s) are
wrapped with a timer in ``AttentionInterface``, so every layer's call is summed per run. The
figures are the minimum over ``--rounds`` runs after a warm-up run (which also compiles the
Numba kernels). Prints a Markdown table.

Usage (the figures of docs/transformers.md)::

    NUMBA_NUM_THREADS=2 python scripts/bench_transformers.py --threads 2
    NUMBA_NUM_THREADS=2 python scripts/bench_transformers.py --threads 2 --layers 4 --prompt 512 --new 64
    NUMBA_NUM_THREADS=2 python scripts/bench_transformers.py --threads 2 --dense-decode  # + before
"""

import argparse
import copy
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    p.add_argument("--new", type=int, default=256, help="tokens generated after the prompt")
    p.add_argument("--rounds", type=int, default=3, help="timed runs per implementation")
    p.add_argument("--threads", type=int, default=2, help="torch threads (set "
                   "NUMBA_NUM_THREADS to the same number for Numba's)")
    p.add_argument("--pause", type=float, default=1.0, help="seconds of idle before each call")
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--dense-decode", action="store_true",
                   help="also run sdpa_numba with its decode steps on the dense operator "
                   "(the path before the KV-cache decode kernel): a third column")
    return p.parse_args(argv)


class Timed:
    """An attention function that sums the seconds spent in it: ``seconds`` in all calls,
    ``decode`` in those with one query token."""

    def __init__(self, fn):
        self.fn, self.seconds, self.decode = fn, 0.0, 0.0

    def __call__(self, module, query, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(module, query, *args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            self.seconds += dt
            if query.shape[2] == 1:
                self.decode += dt


class Stamps:
    """A generate() streamer that notes when each new token is out: the first ``put`` is the
    prompt, the second the prefill's token, the others one decode step each."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def main(argv=None):
    args = parse_args(argv)
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

    import sdpa_numba.integrations.transformers as hf
    from sdpa_numba import _runtime  # noqa: F401  (threading layer chosen on import)
    import numba

    torch.set_num_threads(args.threads)
    hf.register()
    names = ("sdpa", "sdpa_numba")
    if args.dense_decode:
        names += ("dense_decode",)

        def dense_decode(*a, **kw):
            real, hf._decode_kvcache = hf._decode_kvcache, lambda *_: None
            try:
                return hf.attention_forward(*a, **kw)
            finally:
                hf._decode_kvcache = real

        AttentionInterface.register("dense_decode", dense_decode)
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register("dense_decode", hf.attention_mask)
    timers = {}
    for name in names:
        timers[name] = Timed(AttentionInterface._global_mapping[name])
        AttentionInterface._global_mapping[name] = timers[name]

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.prompt + args.new,
                         tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    models = {}
    for name in names:
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[name] = model.float().eval()
    params = sum(p.numel() for p in models["sdpa"].parameters())
    ids = torch.randint(1, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))

    def prefill(model):
        with torch.no_grad():
            return model(ids).logits[:, -1]

    stamps = {}

    def generate(model):
        stamps[model] = Stamps()
        return model.generate(ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=args.new, min_new_tokens=args.new,
                              do_sample=False, pad_token_id=0, streamer=stamps[model])

    load = os.getloadavg()[0]
    tasks = [("prefill", prefill)] + ([] if args.skip_generate else [("generate", generate)])
    best = {}  # (task, impl) -> (seconds, attention seconds)
    results = {}
    for round_ in range(args.rounds + 1):  # round 0: warm-up and compilation
        for task, fn in tasks:
            for name, model in models.items():
                time.sleep(args.pause)
                timers[name].seconds = timers[name].decode = 0.0
                t0 = time.perf_counter()
                results[task, name] = fn(model)
                seconds = time.perf_counter() - t0
                attention = timers[name].seconds
                if task == "generate":  # the decode steps alone (after the first new token)
                    times = stamps[model].times
                    seconds, attention = times[-1] - times[1], timers[name].decode
                    results["decode", name] = len(times) - 2  # decode steps timed
                if round_ and ((task, name) not in best or seconds < best[task, name][0]):
                    best[task, name] = (seconds, attention)
                print(f"# round {round_} {task:8s} {name:10s} {seconds:8.3f} s, attention "
                      f"{attention:8.3f} s", file=sys.stderr, flush=True)

    # the two implementations agree (same weights): last-token logits, generated tokens
    diff = (results["prefill", "sdpa_numba"] - results["prefill", "sdpa"]).abs().max().item()
    same = (None if args.skip_generate else
            bool(torch.equal(results["generate", "sdpa_numba"], results["generate", "sdpa"])))

    print(f"Llama-style model, {params / 1e6:.0f}M parameters ({args.layers} layers, hidden "
          f"{args.hidden}, {args.heads} heads, {args.kv_heads} KV heads), float32, torch "
          f"{torch.__version__} with {torch.get_num_threads()} threads, Numba "
          f"{numba.__version__} with {numba.get_num_threads()} threads; minimum of "
          f"{args.rounds} runs; load average before {load:.1f}. Prefill logits max |diff| "
          f"{diff:.2e}; generated tokens identical: {same}.\n")
    print("| | sdpa (torch) | sdpa_numba | sdpa_numba speed-up |")
    print("|---|---|---|---|")
    (tp, ap), (np_, anp) = best["prefill", "sdpa"], best["prefill", "sdpa_numba"]
    print(f"| prefill {args.prompt} tokens: tokens/s | {args.prompt / tp:.0f} | "
          f"{args.prompt / np_:.0f} | {tp / np_:.2f}x |")
    print(f"| prefill: attention time (share) | {ap:.3f} s ({ap / tp:.0%}) | "
          f"{anp:.3f} s ({anp / np_:.0%}) | {ap / anp:.2f}x |")
    if not args.skip_generate:
        (td, ad), (nd, and_) = best["generate", "sdpa"], best["generate", "sdpa_numba"]
        steps = results["decode", "sdpa"]
        print(f"| generate {args.new} after {args.prompt}: decode tokens/s | {steps / td:.1f} "
              f"| {steps / nd:.1f} | {td / nd:.2f}x |")
        print(f"| decode: attention time (share) | {ad:.3f} s ({ad / td:.0%}) | "
              f"{and_:.3f} s ({and_ / nd:.0%}) | {ad / and_:.2f}x |")
        if args.dense_decode:
            dd, add = best["generate", "dense_decode"]
            print(f"\nsdpa_numba with dense decode steps: decode {steps / dd:.1f} tokens/s, "
                  f"attention {add:.3f} s ({add / dd:.0%}); the KV-cache decode path's "
                  f"attention speed-up over it: {add / and_:.2f}x; its own over torch's SDPA: "
                  f"{ad / add:.2f}x")


if __name__ == "__main__":
    main()
