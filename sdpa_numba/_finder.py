"""Keeps ``sdpa_numba.cuda`` importable next to numba-cuda's import redirector.

numba-cuda installs (from a ``.pth`` file) a meta-path finder that sends every module whose
name *contains* ``"numba.cuda"`` to its own package; ``"sdpa_numba.cuda"`` contains it, and
the redirector then calls itself until RecursionError (numba-cuda 0.30.4). This finder, put in
front of it, finds our own ``sdpa_numba.cuda`` modules the ordinary way and leaves every other
name alone.
"""

import importlib.abc
import importlib.machinery
import sys

_PREFIX = __package__ + ".cuda"


class _OwnCudaFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == _PREFIX or name.startswith(_PREFIX + "."):
            return importlib.machinery.PathFinder.find_spec(name, path, target)
        return None


def install():
    if not any(isinstance(f, _OwnCudaFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _OwnCudaFinder())
