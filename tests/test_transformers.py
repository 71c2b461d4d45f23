"""Hugging Face transformers models on sdpa_numba (sdpa_numba.integrations.transformers).

Tiny models from configs with random weights (no downloads): each model is built twice with
the same weights, once on sdpa_numba and once on the reference implementation (torch's SDPA,
or "eager" where the model does not take SDPA), and their logits, greedy generations (tokens
and every step's scores) and parameter gradients are compared, in float32 and float64, with
left and right padding. Only the positions that are real tokens are compared: padded query
rows are undefined in every implementation.

Weights are drawn with a large initializer_range so that attention is far from uniform (with
the default 0.02 every key gets nearly the same weight, and a wrong mask hardly shows).
"""

import copy
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import sdpa_numba.integrations.transformers as hf  # noqa: E402
from transformers import (AutoModelForCausalLM, Gemma2Config, LlamaConfig,  # noqa: E402
                          MistralConfig)

#: Relative Frobenius error allowed against the reference, per dtype (logits pass through a
#: few layers and the LM head, so float32 gets some room above the kernels' 1e-5).
RTOL = {torch.float32: 2e-5, torch.float64: 1e-12}
#: The name under which models that declare no torch-SDPA support are loaded (see
#: test_sdpa_in_the_name_is_refused_by_models_without_sdpa).
ALIAS = "numba_attention"
#: transformers' own torch-SDPA functions under a name without "sdpa": the float64 reference
#: for Gemma-2, which refuses "sdpa" (it declares no SDPA support because of soft-capping).
TORCH_SDPA = "torch_reference"
VOCAB = 97


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert hf.register() == "sdpa_numba"
    assert hf.register(ALIAS) == ALIAS
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TORCH_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(TORCH_SDPA, sdpa_mask)


def llama_config():
    # GQA: 8 query heads on 2 key/value heads; head_dim 12 (not a power of two)
    return LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=64, initializer_range=0.3, pad_token_id=0)


def mistral_config():
    # a window of 5 keys on sequences of up to 19 tokens: most rows are cut by it
    return MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, sliding_window=5, initializer_range=0.3,
                         pad_token_id=0)


def gemma2_config(softcap):
    # layers alternate sliding (window 4) and full attention
    return Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=64, sliding_window=4,
                        attn_logit_softcapping=softcap, final_logit_softcapping=None,
                        initializer_range=0.3, pad_token_id=0)


def pair(config, dtype, reference="sdpa", ours="sdpa_numba"):
    """(ours, reference): the same random weights, in ``dtype``, in evaluation mode. Each model
    gets its own copy of the config (from_config writes the implementation into the config it
    is given)."""
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    mine = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=ours)
    mine.load_state_dict(ref.state_dict())
    ref, mine = ref.to(dtype).eval(), mine.to(dtype).eval()
    assert mine.config._attn_implementation == ours
    assert ref.config._attn_implementation == reference
    return mine, ref


def batch(side, lengths=(13, 9, 4), seed=1):
    """Token ids and attention mask of sequences of ``lengths`` padded on ``side``."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        cols = slice(L - n, L) if side == "left" else slice(0, n)
        ids[b, cols] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[b, cols] = 1
    return ids, mask


def rel_err(a, b, keep=None):
    """||a - b|| / ||b|| over the rows where ``keep`` (batch, length) is set."""
    if keep is not None:
        a, b = a[keep.bool()], b[keep.bool()]
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- prefill logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("side", ["left", "right"])
def test_llama_gqa_logits(dtype, side):
    mine, ref = pair(llama_config(), dtype)
    ids, mask = batch(side)
    with torch.no_grad():
        got = mine(ids, attention_mask=mask).logits
        want = ref(ids, attention_mask=mask).logits
        # and unpadded, where the mask builder leaves the causal mask to is_causal
        got_full, want_full = mine(ids[:1]).logits, ref(ids[:1]).logits
    assert got.dtype == dtype
    assert rel_err(got, want, mask) <= RTOL[dtype]
    assert rel_err(got_full, want_full) <= RTOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mistral_sliding_window_logits(dtype):
    mine, ref = pair(mistral_config(), dtype)
    ids, mask = batch("right", lengths=(19, 11, 6))
    with torch.no_grad():
        got = mine(ids, attention_mask=mask).logits
        want = ref(ids, attention_mask=mask).logits
        # the window matters here: without it the reference's logits are far from these
        unwindowed = copy.deepcopy(ref.config)
        unwindowed.sliding_window = None
        wide = AutoModelForCausalLM.from_config(unwindowed, attn_implementation="sdpa")
        wide.load_state_dict(ref.state_dict())
        wide = wide.to(dtype).eval()(ids, attention_mask=mask).logits
    assert rel_err(got, want, mask) <= RTOL[dtype]
    assert rel_err(wide, want, mask) > 1e-3


@pytest.mark.parametrize("dtype, side, reference", [(torch.float32, "left", "eager"),
                                                     (torch.float32, "right", "eager"),
                                                     (torch.float64, "right", TORCH_SDPA)])
def test_gemma2_hybrid_layers_logits(dtype, side, reference):
    """Gemma-2 without soft-capping (alternating sliding and full layers, query_pre_attn
    scaling) against eager, which transformers runs Gemma-2 with, and in float64 against
    torch's SDPA (eager computes its softmax in float32, and its float64 additive mask,
    finfo.min, overflows to -inf: padded rows become NaN and reach the real rows)."""
    mine, ref = pair(gemma2_config(softcap=None), dtype, reference=reference, ours=ALIAS)
    ids, mask = batch(side, lengths=(11, 7, 3))
    with torch.no_grad():
        got = mine(ids, attention_mask=mask).logits
        want = ref(ids, attention_mask=mask).logits
    assert rel_err(got, want, mask) <= RTOL[dtype]


# ---------------------------------------------------------------- generate with the KV cache


def generate(model, ids, mask, n):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0)
    return out.sequences, torch.stack(out.scores)


class DecodeSpy:
    """Counts the decode steps (one query token) and where each went: the KV-cache operator
    (with the keywords it was given) or a dense launch."""

    def __init__(self, monkeypatch):
        import sdpa_numba.torch as snt

        self.kvcache, self.dense, self.decoding = [], [], False
        real_kvcache, real_dense, real_decode = (snt.attention_with_kvcache, hf._dense,
                                                 hf._decode)

        def kvcache(q, *args, **kwargs):
            self.kvcache.append((tuple(q.shape), kwargs))
            return real_kvcache(q, *args, **kwargs)

        def dense(query, *args):
            if self.decoding:
                self.dense.append(tuple(query.shape))
            return real_dense(query, *args)

        def decode(query, *args):
            self.decoding = True
            try:
                return real_decode(query, *args)
            finally:
                self.decoding = False

        monkeypatch.setattr(snt, "attention_with_kvcache", kvcache)
        monkeypatch.setattr(hf, "_dense", dense)
        monkeypatch.setattr(hf, "_decode", decode)


@pytest.mark.parametrize("config, dtype", [(llama_config, torch.float32),
                                           (llama_config, torch.float64),
                                           (mistral_config, torch.float32)],
                         ids=["llama-float32", "llama-float64", "mistral-float32"])
def test_greedy_generation(config, dtype, monkeypatch):
    """Left-padded prompts, 8 new tokens through the KV cache (Mistral's window of 5 is
    passed by the prompt and then by the generated tokens): the same tokens, and every step's
    scores within the tolerance. Every decode step goes to the KV-cache decode operator, the
    left padding as cache_leftpad, never to a dense launch."""
    mine, ref = pair(config(), dtype)
    ids, mask = batch("left", lengths=(9, 6, 2))
    spy = DecodeSpy(monkeypatch)
    got_ids, got_scores = generate(mine, ids, mask, 8)
    monkeypatch.undo()
    want_ids, want_scores = generate(ref, ids, mask, 8)
    assert torch.equal(got_ids, want_ids)
    # the logits processors set some scores to -inf (min_new_tokens: the end token)
    finite = torch.isfinite(want_scores)
    assert torch.equal(torch.isfinite(got_scores), finite) and finite.float().mean() > 0.9
    assert rel_err(got_scores[finite], want_scores[finite]) <= RTOL[dtype]
    # 7 decode steps after the prefill, each layer once per step, one query token each
    assert len(spy.kvcache) == 7 * mine.config.num_hidden_layers and not spy.dense
    for shape, kwargs in spy.kvcache:
        assert shape[1] == 1 and kwargs["is_causal"] is False
        if config is llama_config:  # padding of 0, 3 and 7 tokens before the prompts
            assert kwargs["cache_leftpad"].tolist() == [0, 3, 7]
    if config is mistral_config:  # its window cache keeps the last keys: the window's start
        assert any(kwargs.get("cache_leftpad") is not None for _, kwargs in spy.kvcache)


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_llama_parameter_gradients(dtype):
    """A training step's loss and every parameter's gradient, right padding, padded labels
    ignored (-100)."""
    mine, ref = pair(llama_config(), dtype)
    mine.train(), ref.train()  # attention_dropout is 0: training is deterministic
    ids, mask = batch("right", lengths=(11, 8, 5))
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for model in (mine, ref):
        model.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    assert rel_err(losses[0], losses[1]) <= RTOL[dtype]
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in mine.named_parameters():
        q = ref_params[name]
        assert p.grad is not None and q.grad is not None, name
        if q.grad.norm() > 0:
            assert rel_err(p.grad, q.grad) <= 10 * RTOL[dtype], name
            checked += 1
    assert checked >= 10  # the attention projections of both layers among them


# ---------------------------------------------------------------- what is not supported


@pytest.mark.parametrize("side", ["left", "right", None])
def test_gemma2_softcap_logits(side):
    """Gemma-2 with soft-capping (the softcap variant) against eager, padded on either side
    and unpadded (no mask: the sliding layers' window goes to the kernels as the window
    variant). A cap of 1 with these weights changes the logits: checked."""
    mine, ref = pair(gemma2_config(softcap=1.0), torch.float32, reference="eager", ours=ALIAS)
    ids, mask = batch(side or "left", lengths=(11, 7, 3) if side else (11, 11, 11))
    if side is None:
        mask = None
    with torch.no_grad():
        got = mine(ids, attention_mask=mask).logits
        want = ref(ids, attention_mask=mask).logits
        uncapped = copy.deepcopy(ref.config)
        uncapped.attn_logit_softcapping = None
        wide = AutoModelForCausalLM.from_config(uncapped, attn_implementation="eager")
        wide.load_state_dict(ref.state_dict())
        wide = wide.eval()(ids, attention_mask=mask).logits
    assert rel_err(got, want, mask) <= RTOL[torch.float32]
    assert rel_err(wide, want, mask) > 1e-3


def _windowed(L, S, window):
    """transformers' sliding-window causal mask in the bottom-right frame: query i (position
    i + S - L) sees keys j with i + S - L - window < j <= i + S - L."""
    pos = torch.arange(L)[:, None] + S - L
    j = torch.arange(S)[None, :]
    return (j <= pos) & (j > pos - window)


def _inputs(seed, q_shape, kv_shape):
    """float64 query, key and value of these shapes, and a causal attention layer."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64)
               for shape in (q_shape, kv_shape, kv_shape))
    module = torch.nn.Module()
    module.is_causal = True
    return q, k, v, module, g


def _eager(q, k, v, keep, softcap=None, sinks=None):
    """Eager attention with GQA (key/value heads repeated), a boolean ``keep`` mask, Gemma-2's
    soft cap (scores c * tanh(s / c)) and gpt-oss's sinks (eager_attention_forward: the sink
    joins the softmax as one more logit, then is dropped)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, -float("inf"))
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        return torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1] @ v
    return torch.softmax(s, dim=-1) @ v


def test_sliding_window_softcap_and_sinks_without_a_mask():
    """The function on its own with the variants: a sliding window (no mask: the window
    variant) in prefill and decode (GQA not packed then), soft-capping, and gpt-oss's s_aux
    sinks (its eager formula: the sink joins the softmax as one more logit, then dropped)."""
    F = torch.nn.functional
    q, k, v, module, g = _inputs(3, (2, 4, 9, 8), (2, 2, 9, 8))
    q1 = q[:, :, -1:]
    for query, window in ((q, 3), (q1, 4), (q, 20)):
        want = F.scaled_dot_product_attention(
            query, k, v, _windowed(query.shape[2], 9, window), enable_gqa=True)
        out, _ = hf.attention_forward(module, query, k, v, None, sliding_window=window)
        assert rel_err(out, want.transpose(1, 2)) <= 1e-12
    want = _eager(q, k, v, torch.ones(9, 9, dtype=torch.bool).tril(), softcap=0.7)
    out, _ = hf.attention_forward(module, q, k, v, None, softcap=0.7)
    assert rel_err(out, want.transpose(1, 2)) <= 1e-12
    # sinks (gpt-oss's eager_attention_forward), with a padding mask
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    mask[1, ..., :2] = False
    mask[1, :, :2, 0] = True
    want = _eager(q, k, v, mask, sinks=sinks)
    out, _ = hf.attention_forward(module, q, k, v, mask, s_aux=sinks)
    assert rel_err(out, want.transpose(1, 2)) <= 1e-12


def test_sdpa_in_the_name_is_refused_by_models_without_sdpa():
    """transformers runs its torch-SDPA support check on any name that contains "sdpa":
    Gemma-2 (no SDPA support declared) refuses "sdpa_numba" and takes the alias. If this test
    fails, transformers changed that rule, and the docs' advice can go."""
    with pytest.raises(ValueError, match="does not support an attention implementation"):
        AutoModelForCausalLM.from_config(gemma2_config(softcap=None),
                                         attn_implementation="sdpa_numba")


def test_gpt_oss_sinks_logits_and_gradients():
    """A tiny gpt-oss (attention sinks as s_aux, sliding and full layers, GQA, MoE) against
    eager, left-padded: logits, and the gradients of every layer's sinks (the sinks variant's
    gradient through the operator). Random sinks of ~0.3 change the logits: checked."""
    from transformers import GptOssConfig

    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=4, max_position_embeddings=64, initializer_range=0.3,
                          pad_token_id=0)
    mine, ref = pair(config, torch.float32, reference="eager", ours=ALIAS)
    ids, mask = batch("left", lengths=(10, 6))
    results = []
    for model in (mine, ref):
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits
        logits[mask.bool()].square().sum().backward()
        sinks = [layer.self_attn.sinks.grad.clone() for layer in model.model.layers]
        results.append((logits.detach(), sinks))
    assert rel_err(results[0][0], results[1][0], mask) <= RTOL[torch.float32]
    for got, want in zip(results[0][1], results[1][1]):
        assert rel_err(got, want) <= 1e-4
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.zero_()
        sinkless = ref(ids, attention_mask=mask).logits
    assert rel_err(sinkless, results[1][0], mask) > 1e-3


@pytest.mark.parametrize("kwargs, what", [({"position_bias": torch.zeros(1, 4, 3, 3)},
                                           "position_bias")])
def test_unsupported_attention_features_are_refused(kwargs, what):
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(NotImplementedError, match=what + ".*attn_implementation="):
        hf.attention_forward(torch.nn.Module(), q, q, q, None, **kwargs)


def test_output_attentions_warns_and_gives_none():
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match="output_attentions"):
        out, weights = hf.attention_forward(torch.nn.Module(), q, q, q, None,
                                            output_attentions=True)
    assert weights is None and out.shape == (1, 3, 2, 8)


def test_attention_forward_matches_torch_directly():
    """The function on its own, against torch's SDPA: GQA with a boolean mask; causal from
    the module when no mask is given; decode steps (one query token: the query heads of a
    group packed as rows), without a mask, with one shared by the heads and with one per
    head."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 6, 5, 8, generator=g, dtype=torch.float64),
               torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64),
               torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64))
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    mask[..., 0] = True
    module = torch.nn.Module()
    module.is_causal = True
    k5, v5, q1 = k[:, :, :5], v[:, :, :5], q[:, :, -1:]
    head_mask = torch.rand(2, 6, 1, 7, generator=g) > 0.5
    head_mask[..., 3] = True
    cases = [  # (arguments, scaling, torch's result)
        ((q, k, v, mask), None, F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)),
        ((q, k5, v5, None), 0.4, F.scaled_dot_product_attention(q, k5, v5, is_causal=True,
                                                                scale=0.4, enable_gqa=True)),
        ((q1, k, v, None), 0.4, F.scaled_dot_product_attention(q1, k, v, scale=0.4,
                                                               enable_gqa=True)),
        # decode steps with a mask shared by the heads, and with one mask per query head
        ((q1, k, v, mask[:, :, -1:]), None,
         F.scaled_dot_product_attention(q1, k, v, mask[:, :, -1:], enable_gqa=True)),
        ((q1, k, v, head_mask), None,
         F.scaled_dot_product_attention(q1, k, v, head_mask, enable_gqa=True))]
    for args, scaling, want in cases:
        out, weights = hf.attention_forward(module, *args, scaling=scaling)
        assert weights is None
        assert out.shape == want.transpose(1, 2).shape and out.is_contiguous()
        assert rel_err(out, want.transpose(1, 2)) <= 1e-12


def test_decode_steps_go_to_the_kvcache_operator(monkeypatch):
    """One query token: masks that are one run of keys per sequence (none, left padding,
    a static cache's empty tail, both; boolean or additive, shared by the batch) go to the
    KV-cache operator and equal torch's SDPA; other masks (holes, per head, additive values
    other than 0 and -inf, a row without keys), gradients and dropout go to a dense launch."""
    F = torch.nn.functional
    q1, k, v, module, _ = _inputs(4, (3, 6, 1, 8), (3, 2, 11, 8))
    j = torch.arange(11)

    def runs(starts, ends):
        s, e = torch.tensor(starts)[:, None], torch.tensor(ends)[:, None]
        return ((j >= s) & (j < e))[:, None, None, :]

    left = runs([0, 4, 9], [11, 11, 11])
    both = runs([2, 0, 5], [11, 7, 6])
    additive = torch.zeros(3, 1, 1, 11, dtype=torch.float64).masked_fill(~both, -float("inf"))
    holes = left.clone()
    holes[1, ..., 6] = False
    scaled = additive.clone()
    scaled[0, ..., 3] = 0.5
    empty = left.clone()
    empty[2] = False
    kv_path = [None, left, both, additive, runs([3], [10])]
    dense_path = [holes, left.expand(3, 6, 1, 11), scaled]
    for mask in kv_path + dense_path:
        spy = DecodeSpy(monkeypatch)
        out, _ = hf.attention_forward(module, q1, k, v, mask, scaling=0.4)
        want = F.scaled_dot_product_attention(q1, k, v, mask, scale=0.4, enable_gqa=True)
        assert rel_err(out, want.transpose(1, 2)) <= 1e-12
        on_kv = any(mask is m for m in kv_path)
        assert (len(spy.kvcache), len(spy.dense)) == ((1, 0) if on_kv else (0, 1))
        monkeypatch.undo()
    for args, kwargs in (((empty,), {}), ((left,), {"dropout": 0.5})):
        spy = DecodeSpy(monkeypatch)
        hf.attention_forward(module, q1, k, v, *args, **kwargs)
        assert (len(spy.kvcache), len(spy.dense)) == (0, 1)
        monkeypatch.undo()
    # gradients wanted: dense (the decode operator has no backward); the gradient is right
    spy = DecodeSpy(monkeypatch)
    qg = q1.clone().requires_grad_()
    hf.attention_forward(module, qg, k, v, left)[0].sum().backward()
    assert (len(spy.kvcache), len(spy.dense)) == (0, 1)
    qt = q1.clone().requires_grad_()
    F.scaled_dot_product_attention(qt, k, v, left, enable_gqa=True).sum().backward()
    assert rel_err(qg.grad, qt.grad) <= 1e-12


def test_decode_step_variants(monkeypatch):
    """On the KV-cache operator: a sliding layer without a mask sees its last sliding_window
    keys (the run's start), soft-capping and sinks pass as its variants, left-padded: all
    against torch's SDPA or the eager formulas."""
    F = torch.nn.functional
    q1, k, v, module, g = _inputs(5, (2, 4, 1, 8), (2, 2, 9, 8))
    spy = DecodeSpy(monkeypatch)
    window = (torch.arange(9) >= 9 - 4)[None, :]
    out, _ = hf.attention_forward(module, q1, k, v, None, sliding_window=4)
    want = F.scaled_dot_product_attention(q1, k, v, window, enable_gqa=True)
    assert rel_err(out, want.transpose(1, 2)) <= 1e-12
    assert len(spy.kvcache) == 1 and not spy.dense
    assert spy.kvcache[0][1]["cache_leftpad"].tolist() == [5, 5]
    pad = (torch.arange(9) >= torch.tensor([[0], [6]]))[:, None, None, :]
    out, _ = hf.attention_forward(module, q1, k, v, pad, softcap=0.7)
    assert rel_err(out, _eager(q1, k, v, pad, softcap=0.7).transpose(1, 2)) <= 1e-12
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    out, _ = hf.attention_forward(module, q1, k, v, pad, s_aux=sinks)
    assert rel_err(out, _eager(q1, k, v, pad, sinks=sinks).transpose(1, 2)) <= 1e-12
    assert len(spy.kvcache) == 3 and not spy.dense
    (_, capped), (_, sunk) = spy.kvcache[1:]
    assert capped["softcap"] == 0.7 and capped["cache_leftpad"].tolist() == [0, 6]
    assert sunk["sinks"] is sinks


def test_key_range_forms():
    """The run of keys of each sequence from a decode step's mask, or None."""
    j = torch.arange(6)
    assert hf._key_range(None, 2, 6)[1].tolist() == [6, 6]
    mask = ((j >= torch.tensor([[1], [0]])) & (j < torch.tensor([[6], [4]])))[:, None, None]
    start, end = hf._key_range(mask, 2, 6)
    assert start.tolist() == [1, 0] and end.tolist() == [6, 4] and start.dtype == torch.int32
    start, end = hf._key_range(mask[:1], 3, 6)  # one row for the whole batch
    assert start.tolist() == [1, 1, 1] and end.tolist() == [6, 6, 6]
    for bad in (mask.expand(2, 2, 1, 6), mask[..., :5], mask.int(), mask.transpose(2, 3)):
        assert hf._key_range(bad, 2, 6) is None


# ---------------------------------------------------------------- set-up errors


def test_register_refuses_bad_names():
    with pytest.raises(TypeError, match="name must be a str"):
        hf.register(3)
    for name in ("", "sdpa", "eager", "flash_attention_2"):
        with pytest.raises(ValueError, match="name must be a new implementation name"):
            hf.register(name)


def test_missing_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(ImportError, match=r"pip install 'sdpa_numba\[transformers\]'"):
        hf.register()


def test_old_transformers_is_refused(monkeypatch):
    # the module in sys.modules now: transformers replaces its own entry while building models
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.52.3")
    with pytest.raises(ImportError, match=r"transformers >= 5\.0 .*found 4\.52\.3"):
        hf.register()


def test_importing_the_module_imports_neither_torch_nor_transformers():
    code = ("import sys, sdpa_numba.integrations.transformers, sdpa_numba.integrations as i; "
            "assert i.transformers.NAME == 'sdpa_numba'; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_quant_greedy_script(capsys):
    """scripts/quant_greedy.py (docs/serving.md's quant_greedy block) on a tiny model: its
    quantized decode steps run the 8-bit kernel, and its table has a row per format whose
    logits differ from the float32 run's (a format that fell back to the float cache would
    show a difference of exactly 0)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "scripts", "quant_greedy.py")
    spec = importlib.util.spec_from_file_location("quant_greedy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "1",
              "--intermediate", "64", "--vocab", "128", "--prompt", "5", "--new", "3",
              "--init", "0.1", "--formats", "int8,q8_0"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| int8", "| q8_0"))]
    assert [r[1].strip() for r in rows] == ["int8", "q8_0"]
    for r in rows:
        agree = int(r[2].split("/")[0])
        assert 0 <= agree <= 3
        assert float(r[3]) > 0
