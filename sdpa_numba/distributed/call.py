"""The validated ring call: the local checks on every rank, then the collective ones
(:func:`prepare`), giving :class:`Ring`, what every ring step needs."""

import dataclasses
import numbers
from typing import Any

import numpy as np

from ..problem.arguments import check_flag
from ..problem.variant_table import PER_HEAD, RING_REFUSED, RING_SHARDED, is_default
from ..targets import HOST, target_of
from .agreement import compare, digest, signature
from .layouts import check_layout
from .steps import step_work

#: The attention variants of the dense API that ring attention shards (validated as the
#: dense functions do, with the same keywords and defaults), and those it refuses unless off
#: (the user's functions see the positions of one dense call, and a block mask is laid out for
#: the whole (L, S) problem): :mod:`sdpa_numba.problem.variant_table` says which.
_SHARDED = RING_SHARDED
_REFUSED = RING_REFUSED


def _check_variants(attn_mask, dropout_p, variants):
    unknown = sorted(set(variants) - set(_SHARDED) - set(_REFUSED))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")
    if attn_mask is not None:
        raise ValueError("ring attention takes no dense attn_mask: an (L, S) mask cannot be "
                         "sharded along with the keys; use is_causal, window, alignment, "
                         "alibi_slopes, softcap or sinks, which depend on positions only")
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real) \
            or dropout_p != 0:
        raise NotImplementedError(f"ring attention has no dropout yet (dropout_p={dropout_p!r}):"
                                  f" pass dropout_p=0")
    used = [name for name in _REFUSED if not is_default(name, variants.get(name))]
    if "chunk" in used:
        raise NotImplementedError(
            "ring attention does not shard chunk (chunked local attention) yet: its steps "
            "split the keys by the window alone; a chunk of c tokens needs no ring (each "
            "rank's queries see only their chunk's keys), so call the dense function on the "
            "chunks a rank holds")
    if used:
        raise NotImplementedError(
            f"ring attention does not shard {', '.join(used)}: a score_mod or mask_mod is "
            f"called with the positions i, j of one dense call (not the global ones), and a "
            f"block_mask covers the whole (L, S) problem; the variants that depend on global "
            f"positions only (is_causal, window, alignment, alibi_slopes) and softcap and "
            f"sinks are sharded")
    return {name: variants[name] for name in _SHARDED if name in variants}


def _target(named):
    """The arrays' target (:mod:`sdpa_numba.targets`): host arrays (NumPy, torch CPU
    tensors, ...) run on the host, CUDA arrays (Numba device arrays, real or simulated, CuPy,
    torch CUDA tensors) on the device; TypeError for anything else or a mix."""
    return target_of(named, [n for n, _ in named])


def _check_arrays(named):
    for name, x in named:
        least = 1 if name == "lse" else 2
        if x.ndim < least:
            raise ValueError(f"{name} must have at least {least} dims, got shape {x.shape}")


def _check_local(q, k, layout):
    # tuple(): the CUDA simulator's shapes take no negative index
    L, S = tuple(q.shape)[-2], tuple(k.shape)[-2]
    if layout == "zigzag" and (L % 2 or S % 2):
        raise ValueError(f"the zigzag layout needs shards of even length (two equal chunks "
                         f"each): query {q.shape}, key {k.shape}")


@dataclasses.dataclass(frozen=True)
class Ring:
    """The validated call: what every ring step needs."""

    scale: float
    enable_gqa: bool
    layout: str
    recipe: Any       # the dense calls' recipe: soft cap, ALiBi; no sinks (offset/window per call)
    goff: int         # the global alignment offset (S - L over the whole sequence, or 0)
    left: int         # the window, causality folded in (NO_LIMIT: unlimited)
    right: int
    sinks: Any        # the plan's recipe with the sinks (None without)
    hq: int
    batch: tuple
    L: int
    out_shape: tuple  # this rank's output shard
    dtype: Any
    target: Any       # sdpa_numba.targets.HOST (NumPy arrays) or CUDA (Numba device arrays)
    stage: bool       # device buffers go through host buffers (the transport cannot take them)

    @property
    def device(self):
        """The target's name, "host" or "cuda"."""
        return self.target.name

    def work(self, n_q, n_k, size, rank, src):
        return step_work(self.layout, n_q, n_k, size, rank, src, self.goff, self.left,
                     self.right, self.recipe.alibi is not None)


def prepare(coll, arrays, names, is_causal, scale, enable_gqa, layout, attn_mask, dropout_p,
             variants, extra=None):
    """The local and the collective checks; every rank raises if one fails. Returns the
    validated call as a :class:`Ring`."""
    errors = []
    target, restore = HOST, None
    try:
        sharded = _check_variants(attn_mask, dropout_p, variants)
        check_layout(layout)
        is_causal = check_flag("is_causal", is_causal)
        enable_gqa = check_flag("enable_gqa", enable_gqa)
        target = _target(list(zip(names, arrays)))
        # Views of the caller's arrays (no copies; the ring sends copies of the shards) and
        # the function that hands results back as the query's kind (a torch tensor for one).
        arrays, restore = target.adopt(list(zip(names, arrays)))
        if target is not HOST:
            from ..gpu.arrays import is_simulated_mode

            target.check_strides(list(zip(names, arrays)))
            from .._bf16 import is_bfloat16

            if any(is_bfloat16(x.dtype) for x in arrays):
                # The ring's merge and sum kernels (sdpa_numba.gpu.ring) read and write plain
                # floats; bfloat16 storage would need the kernels' storage views.
                raise NotImplementedError("ring attention on bfloat16 CUDA arrays is not built "
                                          "yet: pass float16, float32 or float64, or NumPy "
                                          "arrays")
            # The simulator's arrays are host memory without __cuda_array_interface__.
            stage = is_simulated_mode() or not coll.group.device_buffers()
        else:
            stage = False
        _check_arrays(list(zip(names, arrays)))
        if extra is not None:
            extra(arrays)
        q, k = arrays[names.index("query")], arrays[names.index("key")]
        _check_local(q, k, layout)
        from ..problem import plan

        # The dense functions' checks of the shards and of the variants (its recipe's offset
        # is the shards' S - L; the whole sequence's is size times that).
        p = plan(q, k, arrays[names.index("value")], None, is_causal, scale, enable_gqa,
                 **sharded)
        r = p.recipe
        ring = Ring(scale=p.scale, enable_gqa=enable_gqa, layout=layout,
                     recipe=r._replace(sinks=None, offset=np.int64(0)),
                     goff=coll.size * int(r.offset), left=int(r.left), right=int(r.right),
                     sinks=None if r.sinks is None else r, hq=p.hq, batch=p.batch, L=p.L,
                     out_shape=p.out_shape, dtype=p.dtype, target=target, stage=stage)
    except Exception as e:  # every rank must hear of it before anyone communicates
        errors.append(e)
    coll.agree(errors, "before the first step (bad input)")
    sig = signature(arrays, is_causal=is_causal, scale=ring.scale, enable_gqa=enable_gqa,
                    device=target.name, layout=layout, window=(ring.left, ring.right),
                    offset=ring.goff, softcap=float(r.softcap),
                    **{v.name: digest(getattr(r, v.field)) for v in PER_HEAD if v.ring})
    compare(coll, sig, names)
    return ring, arrays, (restore or (lambda x: x))
