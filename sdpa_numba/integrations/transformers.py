"""Hugging Face transformers models on sdpa_numba: one call, then ``attn_implementation=``.

::

    import sdpa_numba.integrations.transformers as sdpa_numba_hf
    from transformers import AutoModelForCausalLM

    sdpa_numba_hf.register()   # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa_numba")

:func:`register` adds ``"sdpa_numba"`` to transformers' ``AttentionInterface`` (the attention
function, :func:`attention_forward`) and ``AttentionMaskInterface`` (the mask the model builds
for it, :func:`attention_mask`: without a registered mask function transformers silently gives a
custom attention no mask at all, and padding would be ignored). Prefill, ``generate`` with the
model's KV cache, left and right padding, grouped-query attention, sliding-window layers and
training (gradients through the PyTorch operator of :mod:`sdpa_numba.torch`) work; tested in
float32 and float64 on CPU tensors (float16, bfloat16 and CUDA tensors go to the same operator,
which takes them, but no model runs them in the tests).

What reaches the kernels, and where later work plugs in:

* The mask: the boolean mask transformers builds for torch's SDPA (True = takes part), or None
  where a plain causal (or no) mask suffices, which becomes ``is_causal``.
* Sliding windows (Mistral, the local layers of Gemma-2, ...): without a mask (``is_causal``)
  the layer's ``sliding_window`` becomes the operator's ``window=(sliding_window - 1, 0)``
  variant (bottom-right aligned; transformers' window: a query sees its ``sliding_window``
  last keys, itself included), whose kernels skip the key blocks outside it. When
  transformers builds a mask (padding, static caches), the window is inside that dense mask
  and it alone is used: correct, but the kernels visit every key block. The window is not
  also passed then, because the bottom-right frame is only right when the keys end at the
  queries, which a static cache (empty slots after the prompt) breaks. (Sliding-window
  caches keep fewer keys than positions, which the bottom-right frame gets right.)
* Soft-capped scores (Gemma-2's ``attn_logit_softcapping``) go to the operator's
  ``softcap=`` (forward and gradients).
* Attention sinks (gpt-oss's ``s_aux``, one logit per query head) go to ``sinks=``, with
  their gradient in training.
* Decode steps (one query token against the cache) go through :func:`_decode` to the KV-cache
  decode operator (``torch.ops.sdpa_numba.attention_with_kvcache``), reading transformers'
  cache tensors in place; the mask becomes each sequence's run of keys (``cache_leftpad``,
  ``cache_seqlens``), soft-capping and sinks its variants. Gradients, dropout and masks of
  other forms keep the dense operator.
* Additive position biases (``position_bias``) raise NotImplementedError, saying which
  implementation to use instead.

transformers >= 5.0 (its ``AttentionMaskInterface``) is needed; this module imports it (and
torch) only when :func:`register` or the attention function runs. transformers decides whether
a model "supports SDPA" by looking for ``"sdpa"`` in the implementation's name, so models that
declare no torch-SDPA support (Gemma-2, gpt-oss, ...) refuse the name ``"sdpa_numba"`` when
loaded; ``register("numba_attention")`` registers the same functions under a name without it.
"""

import re
import warnings

__all__ = ["register", "attention_forward", "attention_mask", "NAME", "MIN_TRANSFORMERS"]

#: The name :func:`register` registers by default: ``attn_implementation="sdpa_numba"``.
NAME = "sdpa_numba"

#: The oldest transformers release this integration takes (its attention and mask interfaces).
MIN_TRANSFORMERS = (5, 0)

_INSTALL = "pip install 'sdpa_numba[transformers]'"


def _version_tuple(version):
    """``(major, minor)`` of a version string such as ``"5.24.0"`` or ``"5.0.0.dev0"``."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _import_transformers():
    """The transformers module, or ImportError saying what to install."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "sdpa_numba.integrations.transformers needs Hugging Face transformers >= "
            f"{'.'.join(map(str, MIN_TRANSFORMERS))} (and torch): {_INSTALL}") from e
    version = getattr(transformers, "__version__", "0")
    if _version_tuple(version) < MIN_TRANSFORMERS:
        raise ImportError(
            f"sdpa_numba.integrations.transformers needs transformers >= "
            f"{'.'.join(map(str, MIN_TRANSFORMERS))} (its AttentionInterface and "
            f"AttentionMaskInterface), found {version}: {_INSTALL}")
    return transformers


def register(name=NAME):
    """Register sdpa_numba with transformers as the attention implementation ``name``.

    After it, ``AutoModelForCausalLM.from_config(config, attn_implementation=name)`` and
    ``from_pretrained(..., attn_implementation=name)`` run the model's attention on
    sdpa_numba (models already loaded switch with ``model.set_attn_implementation(name)``).
    Registers both the attention function (:func:`attention_forward`, with
    ``AttentionInterface``) and the mask it wants (:func:`attention_mask`, with
    ``AttentionMaskInterface``). Calling it again is harmless.

    Parameters
    ----------
    name : str, optional
        The implementation's name, ``"sdpa_numba"`` by default. transformers refuses any name
        containing ``"sdpa"`` for models that declare no torch-SDPA support (Gemma-2, gpt-oss,
        ...): register such models' implementation under a name without it, e.g.
        ``"numba_attention"``.

    Returns
    -------
    str
        ``name``, to pass as ``attn_implementation``.

    Raises
    ------
    ImportError
        transformers is missing or older than :data:`MIN_TRANSFORMERS`.
    TypeError, ValueError
        ``name`` is not a non-empty str, or names one of transformers' own implementations.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name or name in ("eager", "sdpa", "flex_attention", "paged|eager") \
            or name.startswith(("flash_attention", "paged|")):
        raise ValueError(f"name must be a new implementation name, not {name!r} (one of "
                         "transformers' own, or empty)")
    _import_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


def attention_mask(*args, **kwargs):
    """The mask a model builds for sdpa_numba (``AttentionMaskInterface``'s signature).

    transformers' own SDPA mask: a boolean ``(batch, 1, q_length, kv_length)`` tensor, True
    where a key takes part (causality, padding, sliding window and packed sequences folded in),
    or None where ``is_causal`` (or nothing) expresses it. Once the dense operator has the
    window and alignment variants, this is where the mask shrinks to its padding part
    (``(batch, 1, 1, kv_length)``) and the rest becomes variants (see :func:`_variants`).
    """
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def _variants(sliding_window, softcap, sinks=None, masked=False):
    """The operator's variant keywords for a layer's ``sliding_window``, ``softcap`` and
    attention sinks (``s_aux``).

    transformers' sliding window (``masking_utils.sliding_window_overlay``): query position
    ``q`` sees key positions ``kv > q - sliding_window``, i.e. its ``sliding_window`` last keys
    including itself: ``window=(sliding_window - 1, 0)`` with the queries at the end of the
    keys (``alignment="bottom_right"``). Only for a causal layer without a mask
    (``masked=False``): a mask built by transformers already holds the window, in the right
    frame even for static caches, where the bottom-right frame would be wrong (and a
    bidirectional layer's window is not this one).
    """
    variants = {}
    if sliding_window is not None and not masked:
        variants.update(window=(int(sliding_window) - 1, 0), alignment="bottom_right")
    if softcap is not None:
        variants["softcap"] = float(softcap)
    if sinks is not None:
        variants["sinks"] = sinks
    return variants


def _refuse_unsupported(kwargs):
    """NotImplementedError for what a model may pass that sdpa_numba does not compute yet."""
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            "sdpa_numba: this model adds a position bias to its attention scores "
            "(position_bias, e.g. T5-style relative positions), which the sdpa_numba "
            "integration does not support yet: load the model with attn_implementation=\"sdpa\" "
            "or \"eager\"")
    if kwargs.get("output_attentions", False):
        warnings.warn("sdpa_numba never forms the attention probabilities, so it returns None "
                      "for them (output_attentions=True): use attn_implementation=\"eager\" to "
                      "get them", stacklevel=3)


def _dense(query, key, value, mask, dropout, scale, is_causal, gqa, variants):
    """One launch of the dense operator on ``(batch, heads, length, dim)`` tensors."""
    from .. import torch as sdpa_torch

    return sdpa_torch.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
        scale=scale, enable_gqa=gqa, **variants)


#: The variants passed to the KV-cache decode kernel as they are (a sliding window becomes
#: each sequence's first key instead); decode steps with others take the dense path.
_DECODE_VARIANTS = ("softcap", "sinks")


def _key_range(mask, batch, kv_length):
    """Each sequence's keys as one run ``[start, end)``, from a decode step's mask, or None
    when the mask is not of that form.

    transformers' mask for one query token is ``(batch, 1, 1, kv_length)`` (or None: every
    key), boolean (True takes part) or additive (0 takes part, -inf not). Left padding makes a
    row False..False True..True, a static cache's empty slots True..True False..False, and a
    sliding layer's window cuts the start further; each is one run of True. Anything else
    (holes, a per-head or per-query mask, additive values other than 0 and -inf, a row with no
    key at all) gives None: the dense operator takes those. Returns two int32 CPU tensors
    ``(batch,)``.
    """
    import torch

    if mask is None:
        return (torch.zeros(batch, dtype=torch.int32),
                torch.full((batch,), kv_length, dtype=torch.int32))
    if mask.dim() != 4 or mask.shape[1:3] != (1, 1) or mask.shape[0] not in (1, batch) \
            or mask.shape[3] != kv_length:
        return None
    rows = mask[:, 0, 0]
    if rows.dtype == torch.bool:
        keep = rows
    elif rows.is_floating_point():
        keep = rows == 0
        if not torch.all(keep | torch.isneginf(rows)):
            return None
    else:
        return None
    keep = keep.cpu()
    count = keep.sum(dim=1)
    start = keep.int().argmax(dim=1)  # the first True
    end = start + count
    j = torch.arange(kv_length)
    run = (j >= start[:, None]) & (j < end[:, None])
    if not bool(torch.all(count > 0)) or not torch.equal(run, keep):
        return None
    start, end = start.int(), end.int()
    if rows.shape[0] != batch:
        start, end = start.expand(batch), end.expand(batch)
    return start, end


def _decode(query, key, value, mask, dropout, scale, gqa, variants):
    """A decode step: one query token per sequence against the whole cache.

    The step goes to the KV-cache decode kernel (``torch.ops.sdpa_numba.attention_with_kvcache``,
    split over the cache's length, each cached key and value read once for all the query heads
    of its group): transformers' ``(batch, kv_heads, kv_length, dim)`` key and value (the cache's
    contents, the new token already appended) are viewed as its ``(B, S, H, D)`` cache without
    a copy, nothing is appended, and the one query token sees every key of its run
    (``is_causal=False``). The mask becomes each sequence's run of keys (:func:`_key_range`):
    left padding is ``cache_leftpad``, a static cache's empty tail ``cache_seqlens``. A sliding
    layer without a mask sees its ``sliding_window`` last keys (the window variant's
    bottom-right frame: the keys end at the query), so its run starts there. Soft-capping and
    sinks go to the decode kernel as its variants (:data:`_DECODE_VARIANTS`).

    The dense operator stays the path when gradients are wanted (the decode operator has no
    backward), with dropout, and for masks that are not one run of keys per sequence. There,
    with grouped-query attention, the query heads that share a key/value head become rows of
    one problem, ``(batch, kv_heads, group, dim)`` (FlashAttention's "pack GQA"), so that the
    cache is read once per key/value head; a mask shared by the heads applies to every row as
    it is, a per-head one is packed likewise (windows and sinks are not packed: the packed rows
    would be positions for the window's frame, and sinks are per query head).
    """
    out = _decode_kvcache(query, key, value, mask, dropout, scale, variants)
    if out is not None:
        return out
    batch, q_heads, _, _ = query.shape
    kv_heads = key.shape[1]
    if not gqa or (mask is not None and mask.dim() != 4) or "window" in variants \
            or "sinks" in variants:
        return _dense(query, key, value, mask, dropout, scale, False, gqa, variants)
    group = q_heads // kv_heads
    packed_query = query.reshape(batch, kv_heads, group, query.shape[-1])
    if mask is not None and mask.shape[1] != 1:
        mask = mask.expand(mask.shape[0], q_heads, 1, mask.shape[-1]).reshape(
            mask.shape[0], kv_heads, group, mask.shape[-1])
    out = _dense(packed_query, key, value, mask, dropout, scale, False, False, variants)
    return out.reshape(out.shape[0], q_heads, 1, out.shape[-1])


def _decode_kvcache(query, key, value, mask, dropout, scale, variants):
    """The decode step on the KV-cache operator, ``(batch, q_heads, 1, dim)``; None where it
    does not apply (see :func:`_decode`)."""
    import torch

    from .. import torch as sdpa_torch

    tensors = [query, key, value] + [variants[n] for n in ("sinks",) if n in variants]
    if dropout > 0 or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return None
    batch, kv_length = query.shape[0], key.shape[2]
    if key.shape[0] != batch or value.shape[0] != batch or key.stride(-1) != 1 \
            or value.stride(-1) != 1:
        return None
    run = _key_range(mask, batch, kv_length)
    if run is None:
        return None
    start, end = run
    if "window" in variants:  # (sliding_window - 1, 0), bottom-right: the last keys
        start = torch.clamp(end - (variants["window"][0] + 1), min=0).maximum(start)
    if any(name not in _DECODE_VARIANTS for name in variants if name not in ("window",
                                                                           "alignment")):
        return None
    extra = {name: variants[name] for name in _DECODE_VARIANTS if name in variants}
    if bool(torch.any(start > 0)):
        extra["cache_leftpad"] = start
    out = sdpa_torch.attention_with_kvcache(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), end,
        is_causal=False, scale=scale, **extra)
    return out.transpose(1, 2)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention function (``AttentionInterface``) on sdpa_numba.

    Parameters
    ----------
    module : torch.nn.Module
        The model's attention layer (read for ``is_causal``).
    query : torch.Tensor
        ``(batch, q_heads, q_length, head_dim)``.
    key, value : torch.Tensor
        ``(batch, kv_heads, kv_length, head_dim)`` (the cache's contents in generation);
        ``q_heads`` a multiple of ``kv_heads`` (grouped-query attention, without copies).
    attention_mask : torch.Tensor or None
        From :func:`attention_mask`: boolean (True takes part) or additive float,
        broadcastable to ``(batch, q_heads, q_length, kv_length)``; None: causal (when the
        layer is and ``q_length > 1``) or full attention.
    dropout : float
        Dropout probability on the attention weights (transformers passes 0 in evaluation).
    scaling : float or None
        The scores' scale; None: ``1/sqrt(head_dim)``.
    is_causal : bool or None
        Overrides ``module.is_causal`` when given.
    sliding_window : int or None
        The layer's window: the ``window`` variant without a mask, else already in
        ``attention_mask`` (see :func:`_variants`).
    softcap : float or None
        Soft-capping of the scores (``softcap`` variant).
    **kwargs
        Whatever else the model passes; ``s_aux`` (attention sinks, ``(q_heads,)``) becomes
        the ``sinks`` variant, ``position_bias`` is refused (NotImplementedError),
        ``output_attentions`` warns, the rest is ignored.

    Returns
    -------
    tuple
        ``(out, None)``: ``out`` of shape ``(batch, q_length, q_heads, head_dim)``
        (contiguous), and None for the attention weights, which are never formed.
    """
    _refuse_unsupported(kwargs)
    q_length = query.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal_layer = bool(is_causal)
    # As transformers' SDPA integration: causality comes from is_causal only when the mask
    # builder left it out (None), and never for one query token (it sees the whole cache).
    is_causal = bool(is_causal and attention_mask is None and q_length > 1)
    if is_causal and key.shape[2] > q_length:
        # a first chunk into a static cache: the slots after the prompt are empty
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    # without a mask the keys end at the queries (cut just above for a static cache): the
    # window can go to the kernels bottom-right aligned
    variants = _variants(sliding_window, softcap, kwargs.get("s_aux"),
                         masked=attention_mask is not None or not causal_layer)
    if q_length == 1:
        out = _decode(query, key, value, attention_mask, dropout, scaling, gqa, variants)
    else:
        out = _dense(query, key, value, attention_mask, dropout, scaling, is_causal, gqa,
                     variants)
    return out.transpose(1, 2).contiguous(), None
