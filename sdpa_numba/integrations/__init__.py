"""Integrations of sdpa_numba with other libraries.

Each submodule imports its library lazily (only when used), so that importing
``sdpa_numba.integrations`` needs nothing beyond sdpa_numba itself:

* :mod:`sdpa_numba.integrations.transformers`: Hugging Face transformers models run on
  sdpa_numba with ``attn_implementation="sdpa_numba"`` after one call to
  :func:`sdpa_numba.integrations.transformers.register` (the ``transformers`` extra).
"""

__all__ = ["transformers"]


def __getattr__(name):
    # ``sdpa_numba.integrations.transformers`` as an attribute, imported on first use (the
    # submodule itself imports neither torch nor transformers until register() is called)
    if name == "transformers":
        import importlib

        return importlib.import_module(".transformers", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
