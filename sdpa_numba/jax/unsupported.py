"""The serving functions under JAX: not built yet."""


def varlen_attention(*args, **kwargs):
    """Not built yet under JAX: use :func:`sdpa_numba.varlen_attention` on NumPy arrays."""
    raise NotImplementedError("sdpa_numba.jax.varlen_attention is not built yet: use "
                              "sdpa_numba.varlen_attention on NumPy arrays (outside jax.jit)")


def attention_with_kvcache(*args, **kwargs):
    """Not built yet under JAX: use :func:`sdpa_numba.attention_with_kvcache` on NumPy arrays."""
    raise NotImplementedError("sdpa_numba.jax.attention_with_kvcache is not built yet: use "
                              "sdpa_numba.attention_with_kvcache on NumPy arrays (outside "
                              "jax.jit)")
