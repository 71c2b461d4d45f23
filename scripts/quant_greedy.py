#!/usr/bin/env python
"""Greedy decoding of a small Llama-style model with an 8-bit KV cache against a float32 cache
(issue 29's accuracy report): how often the next token stays the same.

One model with random weights (no checkpoint is downloaded; ``--seed``), float32, its
attention on sdpa_numba through the transformers integration. After a prompt of ``--prompt``
random tokens it decodes ``--new`` tokens greedily, once per cache format:

* ``float32``: the reference, sdpa_numba's decode kernel over transformers' float32 cache;
* ``float16`` (with float16 queries), ``int8``, ``q8_0``, ``e4m3fn``, ``e5m2``: each decode step quantizes the
  cache's keys and values with :func:`sdpa_numba.quantize_kv` (int8: a scale per token and
  head; q8_0: per 32 values; fp8: a descale per sequence and head, from the cache's absmax at
  that step) and runs :func:`sdpa_numba.attention_with_kvcache` on the 8-bit cache and its
  scales: the quantized kernel, not a dequantized copy. int8 and q8_0 scales depend on their
  own token only, so this is the cache an append would have written; the fp8 descales follow
  the whole cache. The prompt's forward reads float32 keys and values in every run (the
  8-bit formats apply to the decode steps).

Three figures per format:

* **top-1 agreement, teacher-forced**: every run is fed the float32 run's tokens, and step
  ``t`` agrees where the format's most likely next token is the float32 run's;
* the largest difference of a logit from the float32 run's, teacher-forced (to read against
  the float32 run's median gap between its two top logits, printed above the table);
* **free-running**: the steps until the format's own greedy sequence first differs.

A random model's next-token distribution is much flatter than a trained model's (the top
two logits are close), so a format's disagreements here are an upper bound of what a trained
model shows; the float16 row is the scale to read the others against. Attention weighs more in
the output the larger the weights (``--init``, transformers' default 0.02).

    PYTHONPATH=. python scripts/quant_greedy.py [--layers 4 --prompt 128 --new 64]
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FORMATS = ("float32", "float16", "int8", "q8_0", "e4m3fn", "e5m2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="tokens decoded after the prompt")
    p.add_argument("--seed", type=int, default=0, help="the weights' and the prompt's seed")
    p.add_argument("--init", type=float, default=0.02, help="the weights' standard deviation")
    p.add_argument("--formats", default=",".join(FORMATS[1:]),
                   help="comma-separated formats besides float32: " + ", ".join(FORMATS[1:]))
    return p.parse_args(argv)


class QuantizedDecode:
    """transformers' attention function: sdpa_numba's, with the decode steps (one query token)
    run on the cache quantized to ``fmt`` (``"float32"``: the float cache as it is)."""

    def __init__(self, attention_forward):
        self.attention_forward = attention_forward
        self.fmt = "float32"

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        if query.shape[2] != 1 or self.fmt == "float32":
            return self.attention_forward(module, query, key, value, attention_mask, *args,
                                          **kwargs)
        import numpy as np
        import torch

        import sdpa_numba

        # transformers' (batch, heads, length, dim) as the cache's (batch, length, heads, dim)
        q = query.detach().transpose(1, 2).numpy()
        k = np.ascontiguousarray(key.detach().transpose(1, 2).numpy())
        v = np.ascontiguousarray(value.detach().transpose(1, 2).numpy())
        lens = np.full(q.shape[0], k.shape[1], np.int32)
        scaling = kwargs.get("scaling")
        if self.fmt == "float16":
            # a float16 cache takes float16 queries
            out = sdpa_numba.attention_with_kvcache(
                q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), lens,
                scale=scaling).astype(np.float32)
        else:
            per_head = {"per_head": True} if self.fmt in ("e4m3fn", "e5m2") else {}
            kq, ks = sdpa_numba.quantize_kv(k, self.fmt, **per_head)
            vq, vs = sdpa_numba.quantize_kv(v, self.fmt, **per_head)
            out = sdpa_numba.attention_with_kvcache(q, kq, vq, lens, k_scale=ks, v_scale=vs,
                                                    scale=scaling)
        return torch.from_numpy(np.ascontiguousarray(out)), None


def decode(model, ids, new, forced=None):
    """Greedy decoding of ``new`` tokens after ``ids``: the tokens (the model's choices) and
    each step's logits; with ``forced``, the model fed ``forced``'s tokens instead of its
    own."""
    import torch
    from transformers import DynamicCache

    tokens, logits = [], []
    cache = DynamicCache()  # filled in place by each forward
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        for t in range(new):
            logits.append(out.logits[0, -1].clone())
            tok = logits[-1].argmax(-1)
            tokens.append(int(tok))
            nxt = tok if forced is None else torch.tensor([forced[t]])
            out = model(nxt.view(1, 1), cache=cache, use_cache=True)
    return tokens, torch.stack(logits)


def main(argv=None):
    args = parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:
        if f not in FORMATS[1:]:
            raise SystemExit(f"--formats: unknown format {f!r} (one of {FORMATS[1:]})")
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig
    from transformers.masking_utils import AttentionMaskInterface

    import sdpa_numba.integrations.transformers as hf

    hf.register()
    attention = QuantizedDecode(hf.attention_forward)
    AttentionInterface.register("quantized_decode", attention)
    AttentionMaskInterface.register("quantized_decode", hf.attention_mask)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.prompt + args.new + 1,
                         tie_word_embeddings=False, pad_token_id=0,
                         initializer_range=args.init)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="quantized_decode")
    model = model.float().eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(1, args.vocab, (1, args.prompt), generator=gen)

    ref, ref_logits = decode(model, ids, args.new)
    top2 = ref_logits.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).median())
    head_dim = args.hidden // args.heads
    print(f"Llama-style, random weights (seed {args.seed}): {args.layers} layers, hidden "
          f"{args.hidden}, {args.heads} query heads / {args.kv_heads} key-value heads "
          f"(D{head_dim}), vocabulary {args.vocab}; prompt {args.prompt} tokens, {args.new} "
          f"greedy decode steps; float32 model and queries; weights' standard deviation "
          f"{args.init}; the float32 run's median gap between its top two logits "
          f"{margin:.3g}\n")
    print("| cache | top-1 agreement, teacher-forced | largest logit difference, "
          "teacher-forced | free-running: steps until the first different token |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| float32 (reference) | {args.new}/{args.new} | 0 | {args.new} |")
    for fmt in formats:
        attention.fmt = fmt
        forced, logits = decode(model, ids, args.new, forced=ref)
        free, _ = decode(model, ids, args.new)
        attention.fmt = "float32"
        agree = sum(a == b for a, b in zip(forced, ref))
        first = next((t for t, (a, b) in enumerate(zip(free, ref)) if a != b), args.new)
        diff = float((logits - ref_logits).abs().max())
        print(f"| {fmt} | {agree}/{args.new} ({100 * agree / args.new:.0f}%) | {diff:.2g} | "
              f"{first} |")


if __name__ == "__main__":
    main()
