"""What the test modules share (imported as ``helpers``: tests/ is on ``sys.path``, as for ``conftest``): the backend
lists, built from the registries (``mhc_cute.backends.BACKENDS``, ``mhc_cute.ops.OP_BACKENDS``), the skip of a backend
this machine cannot run, a misaligned buffer, plan counting, and compiling Triton kernels outside the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mhc_cute import backends, ops
from mhc_cute.accuracy import FORMS, STANDALONE_OPS

# the seams' backends: all of them (the GPU suites), the kernel backends (all but the reference), and those that run
# CPU tensors (the reference; Triton under its interpreter, TRITON_INTERPRET=1 as tests/conftest.py sets it)
SEAM_BACKENDS = list(backends.BACKENDS)
KERNEL_BACKENDS = [n for n, b in backends.BACKENDS.items() if b.kind != "reference"]
CPU_BACKENDS = [n for n, b in backends.BACKENDS.items() if b.kind in ("reference", "triton")]
ACTIVATIONS = ("x_prev", "residual_prev", "post_mix_prev", "comb_mix_prev")  # a seam's per-token inputs

# (op, form, pre) of every seam call: pre None for mhc_fused_hc; "carried" / "identity" for the delayed seam's
# pre_mix_prev given / None (``accuracy.make_inputs``'s ``pre``). V4.1's entry: the broadcast form with the identity.
SEAM_PRES = {"fused_hc": (None,), "fused_hc_delayed": ("carried", "identity")}
SEAM_VARIANTS = [(op, form, pre) for op, pres in SEAM_PRES.items() for form in FORMS for pre in pres]


def variant_id(variant) -> str:
    return "-".join(map(str, variant))


def op_cases(kinds=None) -> list[tuple[str, str]]:
    """(op, backend) of every standalone op's backends (of ``kinds``, ``OpBackend.kind``, when given)."""
    return [(op, b) for op in STANDALONE_OPS for b, spec in ops.OP_BACKENDS[op].items()
            if kinds is None or spec.kind in kinds]


OP_CPU_CASES = op_cases(("reference", "triton"))
OP_GPU_CASES = op_cases()


def backend_params(cpu=CPU_BACKENDS, gpu=SEAM_BACKENDS) -> list:
    """``backend, device`` parameters: each of ``cpu`` on the CPU, each of ``gpu`` on CUDA (marked ``gpu``)."""
    return ([pytest.param(b, "cpu", id=f"{b}-cpu") for b in cpu]
            + [pytest.param(b, "cuda", id=f"{b}-cuda", marks=pytest.mark.gpu) for b in gpu])


def skip_unless_available(backend: str, device="cpu") -> None:
    """Skip the test where seam backend ``backend`` cannot run on ``device`` (``"auto"`` always can)."""
    if backend == "auto":
        return
    why = backends.unavailable_reason(backend, torch.device(device))
    if why is not None:
        pytest.skip(f"{backend} unavailable: {why}")


def skip_unless_op_available(op: str, backend: str, device="cpu") -> None:
    why = ops.unavailable_reason(op, backend, torch.device(device))
    if why is not None:
        pytest.skip(f"{op} on {backend} unavailable: {why}")


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``t``'s shape, dtype and device at a base 2 bytes past a 16-byte boundary."""
    raw = torch.empty(t.numel() * t.element_size() + 16, dtype=torch.uint8, device=t.device)
    start = (-raw.data_ptr()) % 16 + 2
    return raw[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


def fresh_plans(monkeypatch) -> list:
    """The seams' plans emptied for the test (restored after); returns the list of the plans made from then on (the
    arguments of each ``api._new_plan`` call), to count."""
    from mhc_cute import api
    from mhc_cute.signatures import RecentSignatures

    made = []
    new_plan = api._new_plan
    monkeypatch.setattr(api, "_PLANS", {})
    monkeypatch.setattr(api, "_RECENT", {False: RecentSignatures(), True: RecentSignatures()})
    monkeypatch.setattr(api, "_new_plan", lambda *args: made.append(args) or new_plan(*args))
    return made


def compile_outside_interpreter(script: str, timeout: int = 300) -> None:
    """Run ``script`` (it prints "compiled" at its end) in a fresh Python without ``TRITON_INTERPRET``, the checkout
    importable: Triton's compilers for real targets, on a machine without their GPUs."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
