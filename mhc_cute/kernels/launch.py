"""The per-call launch of a CuTe seam path: host code only, so its file is left out of the digest that names the
persisted kernels (``kernels.HOST_MODULES``) and an edit here keeps every compiled file."""

from __future__ import annotations

from ..workspace import get_workspace
from . import partials_count, scalar_args


class KernelLaunch:
    """The per-call part of a CuTe path (a backend's prepared ``launch(inputs, out)``), with everything that depends
    only on the call's signature resolved: it takes the current stream's scratch (split-K partials, and ``counters``
    election counters unless None), the prepared form of the weight (``weight(fn)``, or ``fn`` itself when None) and
    calls the ``compiled`` kernels through TVM-FFI. ``inputs``: the flat problem's tensors (``Problem.inputs``,
    ``pre_mix`` last)."""

    __slots__ = ("compiled", "device", "n_partials", "counters", "weight", "scalars", "delayed", "no_post")

    def __init__(self, compiled, problem, tactic, counters: int | None, weight=None):
        self.compiled, self.device = compiled, problem.residual.device
        self.n_partials = partials_count(tactic, problem.m)
        self.counters, self.weight = counters, weight
        self.scalars = scalar_args(problem.scalars)
        self.delayed = problem.delayed
        self.no_post = problem.form == "no_post"

    def __call__(self, inputs, out) -> None:
        self.compiled(*self.arguments(inputs, out))

    def arguments(self, inputs, out) -> tuple:
        """The compiled call's arguments for ``inputs`` on the current stream, in its compiled order: the eight
        inputs (the prepared weight in ``fn``'s place), the four outputs at ``OUTPUT_ARGS`` (without a post
        ``residual_prev`` where ``residual_cur`` goes: the kernels read it there and write nothing), the scratch, the
        delayed seam's ``pre_mix_prev`` and ``pre_mix_cur`` (None, None for ``mhc_fused_hc``), the scalars."""
        ws = get_workspace(self.device)
        fn = inputs[4] if self.weight is None else self.weight(inputs[4])
        return (inputs[0], inputs[1], inputs[2], inputs[3], fn, inputs[5], inputs[6], inputs[7],
                inputs[1] if self.no_post else out[0], out[1], out[2], out[3],
                ws.partials(self.n_partials), None if self.counters is None else ws.counters(self.counters),
                inputs[8] if self.delayed else None, out[4] if self.delayed else None, *self.scalars)


OUTPUT_ARGS = slice(8, 12)  # where a compiled call takes the four outputs (``KernelLaunch.arguments``)
PRE_MIX_CUR_ARG = 15  # where it takes the delayed seam's pre_mix_cur
