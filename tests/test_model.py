"""The V4 and V4.1 forward loops (``mhc_cute.model``) against the same wiring in float64 (the reference loops), every
sublayer's input checked on the way.

Tolerance: every sublayer input and the final output within ``MODEL_TOL`` normwise (relative) of the float64 loop,
by the device the loop ran on (its sizes). A backend's bf16 outputs may round the other way than float64 where a value
sits near a rounding boundary (the contract allows one bf16 ulp, 2^-8 relative, at such elements), and each such flip
travels through the random linear sublayers into every later stream. Measured on the CPU (torch backend, the V4 loop
wired by hand, 2026-12-04): 0 at H = 64 (no flips at these sizes); at H = 1024, M = 64, 4 layers the error grows by
about 3e-4 per sublayer, to 2.3e-3 and 2.8e-3 at the output (two seeds). The CPU tests (3 layers at H = 64, torch and
Triton's interpreter) measured at most 6e-4 (2026-12-04): 2e-3 there. 1e-2 on the GPU leaves room for its tests' 4
layers at H = 7168. Neither lets a wiring error through (a wrong gate or a skipped post moves the output by O(1)).
"""

import math

import pytest
import torch
from helpers import CPU_BACKENDS, SEAM_BACKENDS, skip_unless_available

from mhc_cute import mhc_fused_hc, mhc_head, mhc_post, reference
from mhc_cute.accuracy import normwise
from mhc_cute.model import (
    HeadWeights, SublayerWeights, V41_SCALARS, mhc_forward_v4, mhc_forward_v41, reference_forward_v4,
    reference_forward_v41,
)

MODEL_TOL = {"cpu": 2e-3, "cuda": 1e-2}  # by the device of the loop's output


class Stack:
    """A random model of ``layers`` layers: mHC weights with V4-like statistics, a random linear map per sublayer
    (scaled to keep the streams O(1)), random Engram maps, an embedding of ``m`` tokens; records every sublayer's
    input of a run."""

    def __init__(self, layers: int, h: int, m: int, *, seed: int = 0, engram_layers=(), device="cpu", lead=None):
        g = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=g).to(device)

        self.h = h
        self.lead = (m,) if lead is None else tuple(lead)
        self.embedding = randn(*self.lead, h).bfloat16()
        self.weights = [SublayerWeights(randn(24, 4 * h) / math.sqrt(4 * h), torch.rand(3, generator=g).to(device)
                                        + 0.5, randn(24) * 0.5, (1 + 0.1 * randn(h)).bfloat16())
                        for _ in range(2 * layers)]
        self.maps = [randn(h, h) / math.sqrt(h) for _ in range(2 * layers)]
        self.head = HeadWeights(randn(4, 4 * h) / math.sqrt(4 * h), torch.rand(1, generator=g).to(device) + 0.5,
                                randn(4) * 0.5, (1 + 0.1 * randn(h)).bfloat16())
        self.final_norm = (1 + 0.1 * randn(h)).bfloat16()
        self.engram_maps = {layer: randn(h, h) / math.sqrt(h) * 0.1 for layer in engram_layers}
        self.inputs: list[torch.Tensor] = []
        self.engram_inputs: list[torch.Tensor] = []

    def sublayers(self):
        def make(w):
            def sublayer(x):
                self.inputs.append(x.clone())
                return (x.double() @ w.double()).bfloat16()
            return sublayer
        return [make(w) for w in self.maps]

    def engram(self):
        def make(w):
            def engram(streams):  # streams + a gated value per stream, as V4.1's Engram adds to the residual
                self.engram_inputs.append(streams.clone())
                return (streams.double() + streams.double() @ w.double()).bfloat16()
            return engram
        return {layer: make(w) for layer, w in self.engram_maps.items()}

    def run(self, forward, *args, **kw):
        self.inputs, self.engram_inputs = [], []
        out = forward(self.embedding, self.weights, self.sublayers(), *args, **kw)
        return out, self.inputs, self.engram_inputs


def _compare(got, want):
    (out, inputs, engram_inputs), (out64, inputs64, engram64) = got, want
    tol = MODEL_TOL[out.device.type]
    assert len(inputs) == len(inputs64) and len(engram_inputs) == len(engram64)
    for i, (a, b) in enumerate(zip(inputs, inputs64)):
        assert a.shape == b.shape and a.dtype == torch.bfloat16
        err = normwise(a, b)
        assert err <= tol, f"sublayer {i}'s input: normwise error {err:.2e} > {tol:.0e}"
    for i, (a, b) in enumerate(zip(engram_inputs, engram64)):
        assert normwise(a, b) <= tol, f"Engram {i}'s input: normwise error {normwise(a, b):.2e}"
    err = normwise(out, out64)
    assert out.shape == out64.shape and err <= tol, f"output: normwise error {err:.2e} > {tol:.0e}"
    return err


# --- the float64 loops themselves (no merge needed) ---------------------------------------------------------------

def _v4_by_hand(stack: Stack, backend: str):
    """V4 wired by hand on the public seam and standalone ops, the entry as a seam whose post is the identity
    (x = 0, post = 0, comb = I: the streams pass through exactly) on the 4 copies of the embedding."""
    e = stack.embedding
    m, h = e.numel() // stack.h, stack.h
    residual = e.reshape(m, 1, h).expand(m, 4, h).contiguous()
    seam = None
    sublayers = stack.sublayers()
    y = torch.zeros(m, h, dtype=torch.bfloat16)
    post, comb = torch.zeros(m, 4), torch.eye(4).expand(m, 4, 4).contiguous()
    for w, sublayer in zip(stack.weights, sublayers):
        seam = mhc_fused_hc(y, residual, post, comb, w.fn, w.hc_scale, w.hc_base, norm_weight=w.norm_weight,
                            backend=backend)
        residual, post, comb = seam.residual_cur, seam.post_mix_cur, seam.comb_mix_cur
        y = sublayer(seam.layer_input)
    residual = mhc_post(y, residual, post, comb, backend=backend)
    return mhc_head(residual, *stack.head[:3], norm_weight=stack.head.norm_weight, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_v4_reference_loop_matches_the_ops_wired_by_hand(backend):
    skip_unless_available(backend)
    stack = Stack(3, 64, 5, seed=1)
    stack.inputs = []
    out = _v4_by_hand(stack, backend)
    got = (out, stack.inputs, [])
    _compare(got, stack.run(reference_forward_v4, stack.head))


def test_v41_reference_loop_one_layer_by_hand():
    """One V4.1 layer written out: the entry collapses with identity gates (the embedding itself, then the norm), the
    MoE input with the attention seam's pre gates, the end with the MoE seam's."""
    stack = Stack(1, 64, 4, seed=2)
    out, inputs, _ = stack.run(reference_forward_v41, stack.final_norm)
    s, cd = V41_SCALARS, torch.float64
    w0, w1 = stack.weights
    e = stack.embedding
    r0 = e[:, None, :].expand(4, 4, 64).contiguous()

    def gates(r, w):
        return reference.gates(r, w.fn, w.hc_scale, w.hc_base, rms_eps=s.rms_eps, hc_pre_eps=s.hc_pre_eps,
                               hc_sinkhorn_eps=s.hc_sinkhorn_eps, hc_post_mult_value=s.hc_post_mult_value,
                               sinkhorn_repeat=s.sinkhorn_repeat, compute_dtype=cd)

    assert torch.equal(inputs[0], reference.rms_norm(e, w0.norm_weight, s.norm_eps, cd))
    pre0, post0, comb0 = gates(r0, w0)
    r1 = reference.post((inputs[0].double() @ stack.maps[0].double()).bfloat16(), r0, post0, comb0)
    assert torch.equal(inputs[1], reference.collapse_norm(r1, pre0, norm_weight=w1.norm_weight, norm_eps=s.norm_eps,
                                                          compute_dtype=cd))
    pre1, post1, comb1 = gates(r1, w1)
    r2 = reference.post((inputs[1].double() @ stack.maps[1].double()).bfloat16(), r1, post1, comb1)
    assert torch.equal(out, reference.collapse_norm(r2, pre1, norm_weight=stack.final_norm, norm_eps=s.norm_eps,
                                                    compute_dtype=cd))


def test_v41_reference_engram_sees_the_posted_streams():
    """At an Engram layer the Engram gets the streams after the previous sublayer's post, and the seam after it
    projects what the Engram returned (an Engram that returns its input leaves the run unchanged)."""
    stack = Stack(3, 64, 3, seed=3, engram_layers=(1,))
    with_engram = stack.run(reference_forward_v41, stack.final_norm, engram=stack.engram())
    assert len(with_engram[2]) == 1 and with_engram[2][0].shape == (3, 4, 64)
    identity = stack.run(reference_forward_v41, stack.final_norm, engram={1: lambda r: r})
    plain = stack.run(reference_forward_v41, stack.final_norm)
    assert torch.equal(identity[0], plain[0])
    assert normwise(with_engram[0], plain[0]) > 1e-2  # the Engram's change reaches the output


def test_reference_loops_fp32_close_to_float64():
    stack = Stack(3, 64, 5, seed=4, engram_layers=(1,))
    _compare(stack.run(reference_forward_v4, stack.head, compute_dtype=torch.float32),
             stack.run(reference_forward_v4, stack.head))
    _compare(stack.run(reference_forward_v41, stack.final_norm, engram=stack.engram(), compute_dtype=torch.float32),
             stack.run(reference_forward_v41, stack.final_norm, engram=stack.engram()))


def test_model_lists_are_checked():
    stack = Stack(1, 64, 2)
    with pytest.raises(ValueError, match="2L items"):
        reference_forward_v4(stack.embedding, stack.weights[:1], stack.sublayers()[:1], stack.head)


# --- the op loops (need mhc_fused_hc's broadcast entry and mhc_fused_hc_delayed) ----------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_v4_forward_matches_float64(backend, lead):
    skip_unless_available(backend)
    stack = Stack(3, 64, 0, seed=5, lead=lead)
    _compare(stack.run(mhc_forward_v4, stack.head, backend=backend), stack.run(reference_forward_v4, stack.head))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("engram_layers", [(), (1,), (0, 2)])
def test_v41_forward_matches_float64(backend, engram_layers):
    skip_unless_available(backend)
    stack = Stack(3, 64, 5, seed=6, engram_layers=engram_layers)
    got = stack.run(mhc_forward_v41, stack.final_norm, engram=stack.engram(), backend=backend)
    _compare(got, stack.run(reference_forward_v41, stack.final_norm, engram=stack.engram()))


def test_the_entry_runs_on_auto_where_the_backend_cannot_run_the_broadcast_entry_at_this_h():
    """Paths E/F run the broadcast entry at H % 256 == 0 only; the model's entry seam then takes auto."""
    from mhc_cute import model

    assert model._entry_backend("half_fma", 512) == "half_fma" and model._entry_backend("all_fma", 320) == "auto"
    assert model._entry_backend("half_mma", 320) == "half_mma" and model._entry_backend("auto", 320) == "auto"


GPU_MODEL_CASES = [(h, b) for h in (4096, 5120, 7168) for b in ["auto"] + SEAM_BACKENDS]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 1000])
@pytest.mark.parametrize("h,backend", GPU_MODEL_CASES)
def test_gpu_v4_forward_matches_float64(h, backend, m):
    stack = Stack(4, h, m, seed=7, device="cuda")
    _compare(stack.run(mhc_forward_v4, stack.head, backend=backend), stack.run(reference_forward_v4, stack.head))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 1000])
@pytest.mark.parametrize("h,backend", GPU_MODEL_CASES)
def test_gpu_v41_forward_matches_float64(h, backend, m):
    stack = Stack(4, h, m, seed=8, engram_layers=(1,), device="cuda")
    got = stack.run(mhc_forward_v41, stack.final_norm, engram=stack.engram(), backend=backend)
    _compare(got, stack.run(reference_forward_v41, stack.final_norm, engram=stack.engram()))
