"""The user-facing functions on torch tensors: :func:`scaled_dot_product_attention`,
:func:`varlen_attention`, :func:`attention_with_kvcache` and :func:`merge_attention_states`
check their arguments (naming them) before the operators are called (and traced), then call
the operators; ``SDPAFunction`` is the deprecated name of earlier versions."""

import warnings

import torch
from torch import Tensor

from ..problem.arguments import check_flag
from ..problem.variant_table import NUMBA_LEVEL, check_names, is_default, takes_variants
from .dense import attention_forward
from .serving import (attention_with_kvcache_op, attention_with_kvcache_read_op,
                      kvcache_forward, merge_attention_states_op)
from .tensors import (OP_TENSORS, check_index, check_tensor, op_values, public_variants,
                      seed_tensor)
from .varlen import varlen_attention_forward

FUNC_GRAD = (
    "sdpa_numba.torch: torch.func.grad, vjp, jacrev, jvp and hessian are not supported over "
    "this operator (torch's custom operators with autograd do not support torch.func's "
    "autodiff transforms): use torch.autograd.grad / .backward(); torch.vmap works")


def _check_no_func_grad(*tensors):
    """A clear error inside torch.func's autodiff transforms, instead of torch's message about
    an autograd.Function's setup_context that the user never wrote."""
    is_wrapped = getattr(torch._C._functorch, "is_gradtrackingtensor", None)
    if is_wrapped is not None and any(t is not None and is_wrapped(t) for t in tensors):
        raise NotImplementedError(FUNC_GRAD)


NUMBA_LEVEL_MESSAGE = (
    "sdpa_numba.torch.{func}: {names} cannot cross a PyTorch operator's schema (they are Numba "
    "functions and objects, not tensors or numbers): use the NumPy-level sdpa_numba.{func} / "
    "{func}_backward (which take them with NumPy arrays, and CUDA arrays: torch CUDA tensors "
    "included)")


def _check_schema_arguments(func, tensors, optional, variants):
    """The public wrappers' checks, before the operator is called (and traced): keywords that
    are not variants refused (TypeError), the Numba-level variants refused (NotImplementedError
    naming them and ``func``'s NumPy-level twin), ``tensors`` (name, tensor) required,
    ``optional`` ones and the variants' tensors tensors or None (a bool ``attn_mask``
    allowed). Outside torch.compile, torch.func's autodiff transforms are refused. Returns the
    op's variant arguments (a dict: the window as its two sides)."""
    check_names(func, variants)
    numba_level = [name for name in NUMBA_LEVEL if not is_default(name, variants.get(name))]
    if numba_level:
        raise NotImplementedError(NUMBA_LEVEL_MESSAGE.format(func=func,
                                                             names=", ".join(numba_level)))
    for name, t in tensors:
        if t is None:
            raise TypeError(f"{name} must be a torch.Tensor, got None")
        check_tensor(t, name)
    optional = optional + [(name, variants.get(name)) for name in OP_TENSORS]
    for name, t in optional:
        check_tensor(t, name, mask=name == "attn_mask")
    if not torch.compiler.is_compiling():
        _check_no_func_grad(*(t for _, t in tensors + optional))
    return public_variants(**variants)


@takes_variants()
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, seed=None,
                                 **variants):
    """``torch.nn.functional.scaled_dot_product_attention`` on sdpa_numba's CPU or CUDA
    kernels, as a PyTorch operator: autograd (gradients for query, key, value and a float
    ``attn_mask``), ``torch.compile`` (no graph break), ``vmap``, meta tensors.

    Same arguments and semantics as torch's (``dropout_p`` applies whenever it is > 0, as in
    torch's functional form: pass 0 in evaluation). ``seed`` (an int in ``[0, 2**64)``) fixes
    the dropout mask (see :mod:`sdpa_numba.dropout`: the same seed gives the mask that
    :func:`sdpa_numba.scaled_dot_product_attention` draws); None draws one from torch's
    generator, and the backward replays that mask. CPU tensors run on the CPU kernels, CUDA
    tensors on the CUDA kernels; float16, bfloat16 (needs ml_dtypes), float32, float64; 16-bit
    inputs compute in float32. Double backward works: with ``create_graph=True`` the gradients
    are taken through torch operations (L x S memory) so that they have second-order terms.

    The variants of :func:`sdpa_numba.scaled_dot_product_attention` that fit an operator
    schema, keyword-only, same semantics:

    * ``window=(left, right)``: query ``i`` sees keys ``i' - left <= j <= i' + right``
      (``None`` on a side: unlimited), ``i' = i`` or, with ``alignment="bottom_right"``,
      ``i + S - L`` (which also moves ``is_causal`` and ALiBi's diagonal);
    * ``softcap=c``: scores ``c * tanh(s / c)`` (differentiable);
    * ``chunk=c``: chunked local attention, query ``i`` sees only keys with
      ``i' // c == j // c``;
    * ``alibi_slopes``: a tensor ``(Hq,)`` or ``(*batch, Hq)``; adds ``-slope * |i' - j|``
      (no gradient for the slopes: they are constants in every model that uses them);
    * ``sinks``: a tensor ``(Hq,)``, one logit per head in every row's softmax denominator
      (gpt-oss's attention sinks); differentiable: autograd gives its gradient.

    16-bit slopes or sinks are read in float32. ``score_mod``, ``mask_mod``, ``mod_args``,
    ``score_mod_grad`` and ``block_mask`` raise NotImplementedError: Numba functions cannot
    cross an operator's schema; the NumPy-level API takes them.
    """
    values = _check_schema_arguments(
        "scaled_dot_product_attention", [("query", query), ("key", key), ("value", value)],
        [("attn_mask", attn_mask)], variants)
    out, _ = attention_forward(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa, seed_tensor(seed, dropout_p), *op_values(values))
    return out


@takes_variants()
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, max_seqlen_q=None,
                     max_seqlen_k=None, dropout_p=0.0, is_causal=False, scale=None, seed=None,
                     return_lse=False, block_table=None, seqused_k=None, **variants):
    """:func:`sdpa_numba.varlen_attention` on torch tensors (FlashAttention's
    ``flash_attn_varlen_func`` layout), as the PyTorch operator
    ``torch.ops.sdpa_numba.varlen_attention_forward``: autograd (gradients for q, k, v and
    the sinks; double backward through torch operations, per sequence), ``torch.compile``
    (no graph break), meta tensors.

    Parameters
    ----------
    q : torch.Tensor, shape (total_q, Hq, E)
        A ragged batch packed back to back; float16, bfloat16 (needs ml_dtypes), float32 or
        float64; CPU or CUDA.
    k, v : torch.Tensor, shape (total_k, H, E) / (total_k, H, Ev)
        ``Hq`` a multiple of ``H`` (grouped-query attention).
    cu_seqlens_q, cu_seqlens_k : torch.Tensor of int32 or int64, shape (B + 1,)
        Cumulative sequence lengths (read on the host); sequences of length 0 are allowed.
    max_seqlen_q, max_seqlen_k : int, optional
        FlashAttention's hints: checked to be at least the longest sequence if given.
    dropout_p, is_causal, scale, seed
        As in :func:`scaled_dot_product_attention`: ``seed`` None draws one from torch's
        generator; sequence ``b`` gets the dense stream of batch entry ``b``.
    return_lse : bool
        Also return the log-sum-exp ``(Hq, total_q)`` in the compute dtype (no gradient).
    block_table, seqused_k : torch.Tensor of int32 or int64, optional
        Keys through a paged cache (``k``, ``v`` then ``(num_pages, page_size, H, E / Ev)``)
        or the first ``seqused_k[b]`` keys of each sequence, as
        :func:`sdpa_numba.varlen_attention` takes them (read on the host; ``cu_seqlens_k``
        may then be None). Gradients for ``k`` and ``v`` have the caches' shapes (CPU
        tensors; no double backward).

    Other Parameters
    ----------------
    window, alignment, softcap, alibi_slopes, sinks : as in the dense function
        The variants, as in :func:`scaled_dot_product_attention`, per sequence (rows and keys
        counted from the sequence's first; ``alibi_slopes`` ``(Hq,)`` or ``(B, Hq)``).
    score_mod, mask_mod, mod_args, score_mod_grad, block_mask : refused
        Refused (NotImplementedError): Numba functions cannot cross an operator's schema;
        the NumPy-level :func:`sdpa_numba.varlen_attention` takes them.

    Returns
    -------
    out : torch.Tensor, shape (total_q, Hq, Ev), q's dtype, contiguous
    lse : torch.Tensor, shape (Hq, total_q), only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        Bad input, naming the argument (cu_seqlens' values are checked by the NumPy-level
        API when the operator runs).
    """
    values = _check_schema_arguments("varlen_attention", [("q", q), ("k", k), ("v", v)], [],
                                     variants)
    check_index(cu_seqlens_q, "cu_seqlens_q")
    if cu_seqlens_k is None and block_table is None:
        raise TypeError("cu_seqlens_k is required without block_table")
    # The trailing arguments only when given: the dispatcher's schema defaults otherwise.
    for name, t in (("cu_seqlens_k", cu_seqlens_k), ("block_table", block_table),
                    ("seqused_k", seqused_k)):
        if t is not None:
            check_index(t, name)
    tail = (block_table, seqused_k) if block_table is not None or seqused_k is not None else ()
    out, lse = varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, dropout_p, is_causal, scale,
                                        seed_tensor(seed, dropout_p), *op_values(values), *tail)
    return (out, lse) if return_lse else out


NO_BACKWARD = (
    "sdpa_numba.torch.attention_with_kvcache is an inference operator (it writes the cache and "
    "has no backward): {names} require(s) grad with grad mode on; call it under "
    "torch.no_grad() / torch.inference_mode(), or use sdpa_numba.torch."
    "scaled_dot_product_attention on the cache's contents when gradients are wanted")


def _eager_cpu(*tensors):
    """Whether a call on these tensors (None: absent) would run the operator's CPU kernel
    eagerly: not under ``torch.compile`` or a dispatch mode (fake tensors, ``make_fx``), and
    every tensor a plain CPU tensor, not one wrapped by a torch.func transform (``vmap``'s
    batched tensors have no storage and need the operator's vmap rule). Then the operator's
    body may be called directly."""
    if torch.compiler.is_compiling() or _dispatch_mode() is not None:
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return all(t is None or (type(t) is Tensor and t.device.type == "cpu" and not wrapped(t))
               for t in tensors)


def _dispatch_mode():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


@takes_variants(exclude=NUMBA_LEVEL, defaults={"alignment": None})
def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None,
                           block_table=None, cache_leftpad=None, is_causal=True, scale=None,
                           return_lse=False, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=False, cache_batch_idx=None, k_scale=None,
                           v_scale=None, cu_seqlens_q=None, **variants):
    """:func:`sdpa_numba.attention_with_kvcache` on torch tensors, as the PyTorch operator
    ``torch.ops.sdpa_numba.attention_with_kvcache`` (``torch.compile`` traces it with no graph
    break; meta tensors get shapes), or without ``k`` and ``v`` as
    ``torch.ops.sdpa_numba.attention_with_kvcache_read``, which only reads the caches.

    New query tokens against a key/value cache, contiguous or paged (FlashAttention's
    ``flash_attn_with_kvcache`` layouts), with an optional in-place append of ``k`` and ``v``
    into the caches: the one documented write to an input (the operator declares the caches
    mutated, so torch.compile keeps the write).

    Parameters
    ----------
    q : torch.Tensor, shape (B, Lq, Hq, E)
        float16, bfloat16 (needs ml_dtypes), float32 or float64; CPU or CUDA.
    k_cache, v_cache : torch.Tensor, shape (B, S_max, H, E) / (B, S_max, H, Ev)
        Or ``(num_pages, page_size, H, ·)`` with ``block_table``. q's dtype and device; any
        strides with the last dim contiguous (``key.transpose(1, 2)`` of a ``(B, H, S, E)``
        tensor is taken without a copy).
    cache_seqlens : int or torch.Tensor of ints, shape (B,)
        Keys already in the cache per sequence (read on the host).
    k, v : torch.Tensor, optional
        New keys and values ``(B, Lq_new, H, ·)``, written into the caches first.
    block_table : torch.Tensor of int32, shape (B, max_pages), optional
        A paged cache's page table.
    cache_leftpad : torch.Tensor of ints, shape (B,), optional
        Where each sequence's keys start in its cache (left padding; passed to the NumPy-level
        API, which says whether it takes it).
    is_causal : bool
        Bottom-right aligned causality (default True): query token ``t`` sees the cache and
        the new tokens up to its own position; False: every key.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    return_lse : bool
        Also return the log-sum-exp ``(B, Hq, Lq)`` in the compute dtype.
    rotary_cos, rotary_sin : torch.Tensor, shape (seqlen_ro, rotary_dim // 2), optional
        Rotary embedding of ``q`` and the new ``k`` before the append (needs ``k`` and ``v``),
        as :func:`sdpa_numba.attention_with_kvcache` takes them.
    rotary_interleaved : bool
        GPT-J (pairs of adjacent dims) instead of GPT-NeoX (halves) rotation.
    cache_batch_idx : torch.Tensor of ints, shape (B,), optional
        Which row of a contiguous cache each batch entry uses.
    k_scale, v_scale : torch.Tensor, optional
        The scales of an 8-bit cache (``k_cache``/``v_cache`` int8, ``torch.float8_e4m3fn``
        or ``torch.float8_e5m2``; CPU only), as :func:`sdpa_numba.attention_with_kvcache`
        takes them (an fp8 descale as a 0-d or ``(B, H)`` float32 tensor).
    cu_seqlens_q : torch.Tensor of ints, shape (B + 1,), optional
        A ragged batch (each sequence its own number of new tokens, appends included), as
        :func:`sdpa_numba.attention_with_kvcache` takes it: ``q`` ``(total_q, Hq, E)``, ``k``
        / ``v`` ``(total_q, H, ·)``; ``out`` ``(total_q, Hq, Ev)``, ``lse`` ``(Hq,
        total_q)``.

    Other Parameters
    ----------------
    window, alignment, softcap, alibi_slopes, sinks : as in the dense function
        The variants, spelled as in :func:`scaled_dot_product_attention`; passed to the
        NumPy-level API only when given (None: its defaults), which raises
        NotImplementedError for those it does not take.

    Returns
    -------
    out : torch.Tensor, shape (B, Lq, Hq, Ev), q's dtype, contiguous
    lse : torch.Tensor, shape (B, Hq, Lq), only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        Bad input, naming the argument, before the cache is written.
    NotImplementedError
        When gradients are wanted (grad mode on and an input requires grad): the operator
        has no backward. (Called directly, ``torch.ops.sdpa_numba.attention_with_kvcache``
        registers no autograd; differentiating through it raises torch's "no autograd
        formula" error.) Also under ``torch.vmap`` with ``k`` and ``v`` (an in-place append
        cannot be vmapped: see :func:`attention_with_kvcache_op`); without them, vmap works
        (the vmapped dim joins the batch dim).
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t is None:
            raise TypeError(f"{name} must be a torch.Tensor, got None")
        check_tensor(t, name, cache=name != "q")
    check_names("attention_with_kvcache", variants, exclude=NUMBA_LEVEL)
    tensors = [(name, variants.get(name)) for name in OP_TENSORS]
    rotary = [("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
              ("cache_batch_idx", cache_batch_idx), ("k_scale", k_scale), ("v_scale", v_scale)]
    for name, t in [("k", k), ("v", v), *tensors, *rotary[:2], *rotary[3:]]:
        check_tensor(t, name)
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cu_seqlens_q", cu_seqlens_q)):
        if t is not None:
            check_index(t, name)
    rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    if torch.is_grad_enabled():
        wanting = [name for name, t in [("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                        ("k", k), ("v", v), *tensors]
                   if t is not None and t.requires_grad]
        if wanting:
            raise NotImplementedError(NO_BACKWARD.format(names=", ".join(wanting)))
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if q.dim() < 1:
            raise ValueError(f"q must have 4 dims (B, Lq, Hq, E), got shape {tuple(q.shape)}")
        n_seq = q.shape[0] if cu_seqlens_q is None else max(cu_seqlens_q.shape[0] - 1, 0)
        cache_seqlens = torch.full((n_seq,), cache_seqlens, dtype=torch.int64)
    variants = op_values(public_variants(**{"alignment": None, **variants}))
    # The trailing arguments only when given: the dispatcher's schema defaults otherwise.
    scales = ((k_scale, v_scale, cu_seqlens_q) if cu_seqlens_q is not None
              else (k_scale, v_scale) if k_scale is not None or v_scale is not None else ())
    rotating = any(t is not None for t in (rotary_cos, rotary_sin, cache_batch_idx))
    tail = ((rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx, *scales)
            if rotating or scales else ())
    if _eager_cpu(q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_leftpad,
                  *(t for _, t in tensors), *(t for _, t in rotary), cu_seqlens_q):
        # No tracing, no fake tensors, no dispatch mode: the operator's body itself. Through
        # torch's dispatcher a call costs ~0.1 ms more, as much as a decode step of a small
        # model's layer.
        out, lse = kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                                   cache_leftpad, is_causal, scale, *variants, *tail)
    elif k is None and v is None and not rotating:  # the operator that declares no mutation
        out, lse = attention_with_kvcache_read_op(q, k_cache, v_cache, cache_seqlens,
                                                  block_table, cache_leftpad, is_causal, scale,
                                                  *variants, *scales)
    else:
        out, lse = attention_with_kvcache_op(q, k_cache, v_cache, cache_seqlens, k, v,
                                             block_table, cache_leftpad, is_causal, scale,
                                             *variants, *tail)
    return (out, lse) if return_lse else out


def merge_attention_states(out_a, lse_a, out_b=None, lse_b=None):
    """:func:`sdpa_numba.merge_attention_states` on torch tensors, as the PyTorch operator
    ``torch.ops.sdpa_numba.merge_attention_states``, with autograd (the gradients of both
    results, in torch operations) and ``torch.compile`` support.

    Parameters
    ----------
    out_a, lse_a, out_b, lse_b : torch.Tensor
        Two parts: normalized attention outputs ``(..., Ev)`` over disjoint key sets and their
        log-sum-exp ``(...)``. Or the n-ary form ``merge_attention_states(outs, lses)``:
        ``outs (n, ..., Ev)`` and ``lses (n, ...)`` (lists or tuples of tensors are stacked
        first).

    Returns
    -------
    out : torch.Tensor, shape (..., Ev), the outputs' dtype
    lse : torch.Tensor, shape (...), the compute dtype

    Raises
    ------
    TypeError, ValueError
        Bad input, naming the argument.
    """
    if (out_b is None) != (lse_b is None):
        raise TypeError("merge_attention_states takes (out_a, lse_a, out_b, lse_b) or "
                        "(outs, lses): out_b and lse_b go together")
    if out_b is None:
        out_a, lse_a = (torch.stack(list(x)) if isinstance(x, (list, tuple)) else x
                        for x in (out_a, lse_a))
    if out_a is None:
        raise TypeError("out_a must be a torch.Tensor, got None")
    check_tensor(out_a, "out_a")
    check_tensor(out_b, "out_b")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return merge_attention_states_op(out_a, lse_a, out_b, lse_b)


class SDPAFunction:
    """Deprecated: earlier versions' ``torch.autograd.Function``. ``SDPAFunction.apply(query,
    key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed)`` still works: it
    calls :func:`scaled_dot_product_attention`, with a DeprecationWarning."""

    @staticmethod
    def apply(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, seed=None):
        warnings.warn("sdpa_numba.torch.SDPAFunction is deprecated: call "
                      "sdpa_numba.torch.scaled_dot_product_attention", DeprecationWarning,
                      stacklevel=2)
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                            scale, enable_gqa, seed=seed)
