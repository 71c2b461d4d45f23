"""What every target has: its name, and the launchers called through its back end's launcher
modules (:class:`Target`)."""

from typing import NamedTuple


class Launchers(NamedTuple):
    """A back end's launcher modules (``cpu.launch*`` or ``gpu.launch*``)."""

    dense: object
    backward: object
    varlen: object
    merge: object
    decode: object


class Target:
    """A place the kernels run: its ``name``, its ``label`` in messages, and
    ``load_launchers()``, which imports its back end's launcher modules (in
    :class:`Launchers`' order). Subclasses give the array operations (``adopt``, ``address``,
    ``as_strided``, ``empty``, ``stack``, ``to_host``, ``check_strides``); the launch methods
    here are the same for every target."""

    def __init__(self, name, label, load_launchers):
        #: ``"host"`` or ``"cuda"``.
        self.name = name
        #: The back end's name in messages (``"CPU"``, ``"CUDA"``).
        self.label = label
        self._load_launchers = load_launchers
        self._launchers = None

    def __repr__(self):
        return f"sdpa_numba.targets.{self.name.upper()}"

    def launchers(self):
        """The back end's :class:`Launchers`, imported on first use (then kept)."""
        if self._launchers is None:
            self._launchers = Launchers(*self._load_launchers())
        return self._launchers

    def forward(self, p, query, key, value, attn_mask, out, dropout):
        """The dense forward for plan ``p``: ``(out, lse)`` as this target's arrays."""
        return self.launchers().dense.run(p, query, key, value, attn_mask, out, dropout)

    def backward(self, p, grad_out, query, key, value, attn_mask, out, lse, dropout, mask_grad):
        """The dense backward for plan ``p``: ``(dq, dk, dv, dmask)``."""
        return self.launchers().backward.run_backward(p, grad_out, query, key, value,
                                                      attn_mask, out, lse, dropout, mask_grad)

    def varlen_forward(self, p, q, k, v, out, dropout):
        """The varlen forward for varlen plan ``p``: ``(out, lse)``."""
        return self.launchers().varlen.run(p, q, k, v, out, dropout)

    def varlen_backward(self, p, grad_out, q, k, v, out, lse, dropout):
        """The varlen backward for varlen plan ``p``: ``(dq, dk, dv)``."""
        return self.launchers().varlen.run_backward(p, grad_out, q, k, v, out, lse, dropout)

    def prepare_decode(self, p):
        """The launch of KV-cache problem ``p`` (:func:`sdpa_numba.problem.kvcache.
        kvcache_problem`): ``launch(q, k_cache, v_cache, k, v, out) -> (out, lse)``, which
        appends ``k``, ``v`` (if given) and decodes (:func:`sdpa_numba.cpu.launch_decode.
        prepare`)."""
        return self.launchers().decode.prepare(p)

    def merge(self, parts, dt, ct, lead, ev):
        """The merge of checked attention states ``parts`` (see
        :func:`sdpa_numba.cpu.launch_merge.run`): ``(out, lse)``."""
        return self.launchers().merge.run(parts, dt, ct, lead, ev)
