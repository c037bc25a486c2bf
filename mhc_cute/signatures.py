"""The plans of an op's most recent call signatures, found without building a signature key.

An eager call's host time is spent before its kernels start; the checks its signature needs (every tensor's shape,
strides, dtype, device) cost microseconds when read from Python one attribute at a time. torch's C++ tensor check
(dynamo's ``TensorGuards``: sizes, strides, dtype, device, dispatch keys, requires_grad) makes them in well under a
microsecond for a whole call, so an op keeps its last few signatures with their plans and finds a call's there; a
call that matches none takes the op's full path (its checks, its keyed plans). Where this torch lacks the check,
nothing is remembered and every call takes the full path.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Callable, NamedTuple

try:  # torch internals: optional
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - a torch without it
    TensorGuards = None


class _Entry(NamedTuple):
    guards: object  # TensorGuards of the tensor arguments, in order
    present: Callable  # itemgetter of the tensor arguments
    absent: tuple  # indices of the None arguments (a tensor there is another signature, whatever it holds)
    rest: tuple  # everything else the plan depends on (scalars, backend, ...), compared with ==
    plan: object


class RecentSignatures:
    """The plans of the ``size`` most recent signatures of one op, the most recent first. ``tensors``: the op's
    tensor arguments in a fixed order (None where absent; at least two tensors); ``rest``: a tuple of the other
    arguments its plan depends on."""

    def __init__(self, size: int = 4):
        self.size = size
        self.entries: list[_Entry] = []

    def find(self, tensors: tuple, rest: tuple):
        """The plan of a recent call with this signature, or None."""
        try:
            for e in self.entries:
                if e.rest != rest:
                    continue
                for i in e.absent:
                    if tensors[i] is not None:
                        break
                else:
                    if e.guards.check(*e.present(tensors)):
                        return e.plan
        except (RuntimeError, TypeError):  # an argument of the wrong kind: the full path's checks name it
            pass
        return None

    def remember(self, tensors: tuple, rest: tuple, plan) -> None:
        """Put ``plan`` first, for calls with the signature of ``tensors`` and ``rest`` (checked ones)."""
        if TensorGuards is None:
            return
        present = tuple(i for i, t in enumerate(tensors) if t is not None)
        ts = [tensors[i] for i in present]
        try:
            guards = TensorGuards(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                                  dynamic_dims_strides=[list(t.stride()) for t in ts])
        except (RuntimeError, TypeError, SystemError):  # pragma: no cover - another torch's signature
            return
        absent = tuple(i for i, t in enumerate(tensors) if t is None)
        self.entries = [_Entry(guards, itemgetter(*present), absent, rest, plan), *self.entries[:self.size - 1]]
