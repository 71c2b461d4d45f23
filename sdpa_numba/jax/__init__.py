"""sdpa_numba's attention on JAX arrays, under ``jax.jit``, ``jax.grad`` and ``jax.vmap``:
:func:`scaled_dot_product_attention`, :func:`varlen_attention` (packed ragged batches) and
:func:`attention_with_kvcache` (functional: returns the updated caches, aliased to the inputs).

The CPU kernels run as XLA FFI calls (the typed FFI): each is a Numba ``@cfunc`` that reads
XLA's call frame and calls the kernel, with no Python on the call path (see
:mod:`sdpa_numba.jax._frame` and :mod:`sdpa_numba.jax._handlers`). Needs JAX (the ``jax``
extra: ``pip install sdpa_numba[jax]``).
"""

try:
    import jax  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised without jax installed
    raise ImportError("sdpa_numba.jax needs JAX: pip install 'sdpa_numba[jax]' (or "
                      "pip install jax)") from e


from .dense import scaled_dot_product_attention  # noqa: E402
from .kvcache import attention_with_kvcache  # noqa: E402
from .varlen import varlen_attention  # noqa: E402

__all__ = ["scaled_dot_product_attention", "varlen_attention", "attention_with_kvcache"]
