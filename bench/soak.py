"""A randomized soak: calls with random shapes, backends, tactics, precisions, input scales, layouts, output buffers,
streams and CUDA graphs, each checked against the float64 contract (``mhc_cute.accuracy``); exit status 1 on any
failure, each with a command that reproduces it.

    python bench/soak.py --seconds 540 --seed 1
    python bench/soak.py --seconds 40          # no GPU: the torch backend and Triton's interpreter, small shapes
    python bench/soak.py --replay '{"op": "mhc_fused_hc", ...}'   # one call again, as a failure printed it
    MHC_CUTE_KERNEL_CACHE=/tmp/kc python bench/soak.py --precompile-only --seed 1   # its kernels first (no GPU needed)

Each call of ``mhc_fused_hc`` draws: its form (regular half the time, no post, broadcast entry), M (0, 1, powers of
two, odd sizes, any size; up to tens of thousands on a GPU,
bounded by ``MAX_ELEMENTS_GPU`` elements of ``residual_prev``), H (multiples of 64 up to 8192, or of the backend's
``h_multiple``), a backend (``auto`` and ``torch`` included) and a tactic (its default, a candidate the tuner times,
the most K splits, for Triton other K splits and chunks), the norm (none, bf16 or fp32 weight), the precision, the
inputs' scale (1e-20 to 1e10) with outlier channels (x100) and exact zeros (channels, tokens, post gates), the
gates' saturation (``hc_base`` up to 100), leading dims, non-contiguous or misaligned inputs, ``out=`` buffers
(poisoned with NaN; the flat alternative shapes too), and on a GPU a second stream, or a CUDA graph captured and
replayed on two new sets of activations. Now and then a regular call is made again with a NaN or an infinity in one
value of one token, against the non-finite policy (``accuracy.check_poisoned_token``). On a GPU most draws reuse the
kernel configuration of an earlier one (its backend, H, norm, precision and resolved tactic) with new sizes and
data, so that compiling new kernel variants takes a bounded share of the run (``$MHC_CUTE_KERNEL_CACHE``, default
/tmp/mhc-kcache, keeps them for later runs; ``--precompile-only`` fills it on any machine with the CuTe seam kernels
that a seed's calls will launch on a Hopper GPU).
``mhc_fused_hc_delayed`` (every form too; carried gates or the identity ``pre_mix_prev=None``) and the standalone
ops ``mhc_post``, ``mhc_collapse``, ``mhc_head`` draw the same way (no poisoned tokens), each on the backends that
implement it, checked with ``accuracy.check_outputs`` and ``accuracy.check_op_output``; ``--ops`` picks some, by
default all (weighted towards the two seams). A call's draw is a JSON object; the i-th draw depends only on
``--seed`` and i. A new op is one entry of ``OPS`` (its draw and its run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:  # bench/precompile.py, however this script was loaded
    sys.path.insert(0, str(ROOT / "bench"))
import precompile as precompile_script  # noqa: E402
MAX_ELEMENTS_GPU = 300_000_000  # M * 4H on a GPU: the float64 check's temporaries stay within tens of GB
MAX_M_GPU = 65536
CPU_LIMITS = {"torch": (32, 768), "triton": (6, 256)}  # (largest M, largest H) without a GPU: seconds per call
NEW_CONFIG_GPU = 0.02  # share of GPU draws with a new kernel configuration (a compile, seconds, for most)
SCALES = (1e-20, 1e-4, 1.0, 1e3, 1e10)  # the activations' scale; with x100 outliers every fp32 sum stays finite
POISON = 0.05  # share of calls made again with a NaN or an infinity in one token (``accuracy.check_poisoned_token``)
POISON_TAILS = {"x_prev": (0,), "residual_prev": (4, 0), "post_mix_prev": (4, 1), "comb_mix_prev": (4, 4)}  # 0: H
DEFAULT_KERNEL_CACHE = "/tmp/mhc-kcache"
ACTIVATIONS = ("x_prev", "residual_prev", "post_mix_prev", "comb_mix_prev", "pre_mix_prev")  # a seam's
OP_ACTIVATIONS = ("x", "residual", "post_mix", "comb_mix", "pre_mix")  # a standalone op's


@dataclass
class Env:
    """What draws depend on: the device, the backends that run there (the seams', each standalone op's), and the
    kernel configurations drawn so far (by op)."""

    device: str
    backends: list
    op_backends: dict = field(default_factory=dict)
    new_config: float = 1.0  # share of draws with a new kernel configuration; the others reuse one of ``history``
    sm_count: int = 132
    triton_device: tuple = ("interpreter", 4)  # (architecture, compute units) Triton's tactics are chosen for
    history: dict = field(default_factory=dict)
    stream: object = None


class SoakOp(NamedTuple):
    """An op of the soak: ``draw(rng, env)`` -> a JSON-able description of one call; ``run(draw, env)`` makes the
    inputs, calls and checks (AssertionError when off the contract); ``label(draw)`` for the progress counts."""

    draw: Callable[[random.Random, Env], dict]
    run: Callable[[dict, Env], None]
    label: Callable[[dict], str]
    weight: float = 1.0


# --- mhc_fused_hc -------------------------------------------------------------------------------------------------

def _draw_m(rng: random.Random, max_m: int) -> int:
    kind = rng.random()
    if kind < 0.04:
        return 0
    if kind < 0.2 or max_m < 2:
        return 1
    if kind < 0.5:
        return 1 << rng.randint(1, max(1, int(math.log2(max_m))))
    if kind < 0.8:
        return 2 * rng.randint(1, (max_m - 1) // 2) + 1 if max_m >= 3 else 1
    return max(1, int(math.exp(rng.uniform(0, math.log(max_m)))))


def _draw_lead(rng: random.Random, m: int) -> list:
    kind = rng.random()
    if kind < 0.5:
        return [m]
    if kind < 0.6:
        return rng.choice([[1, m], [m, 1]])
    divisors = [d for d in range(1, min(m, 4096) + 1) if m % d == 0] or [1]
    d = rng.choice(divisors) if m else rng.choice([2, 3])
    if kind < 0.85:
        return [d, m // d if m else 0]
    return [d, 1, m // d if m else 0]


def _draw_tactic(rng: random.Random, backend: str, m: int, h: int, env: Env):
    """None (the default), a CuTe tactic name, or Triton's tactic fields."""
    from mhc_cute import autotune, tactics as tac

    if backend in tac.FMA_PATHS + tac.MMA_PATHS:
        kind = rng.random()
        if kind < 0.4:
            return None
        if kind < 0.9:
            cands = autotune.candidate_tactics(backend, autotune.bucket_of(max(m, 1)), h, env.sm_count)
            return rng.choice(cands).name
        base = tac.default_tactic(backend, max(m, 1), h, env.sm_count)
        if backend in tac.FMA_PATHS:
            most = tac.largest_split(h, base.chunk_h, h)
        else:
            most = h // tac.MMA_BLOCK_H
        t = replace(base, split_k=most)
        return t.name if t.invalid_reason(h) is None and most * max(m, 1) * tac.PARTIAL_COLS < 2**31 else None
    if backend == "triton":
        if rng.random() < 0.5:
            return None
        from mhc_cute.triton import configs

        table = configs.table_for(env.triton_device[0])
        t = rng.choice(table.buckets)[1]
        fields = dict(t.__dict__, split_k=rng.choice([1, 2, 3, 7, t.split_k, 1 << 20]),
                      chunk_m=rng.choice([0, 0, 0, 64, 1000]))
        if env.device != "cuda":  # the interpreter: small blocks (seconds per program)
            fields.update(block_m=min(fields["block_m"], 4), block_h=min(fields["block_h"], 64))
        return fields
    return None


def _resolved_tactic(backend: str, tactic, m: int, h: int, env: Env):
    """``tactic``, or the default it stands for at M (explicit, so that a reuse at another M compiles nothing)."""
    from mhc_cute import tactics as tac

    if tactic is not None or m == 0:
        return tactic
    if backend in tac.FMA_PATHS + tac.MMA_PATHS:
        return tac.default_tactic(backend, m, h, env.sm_count).name
    if backend == "triton":
        from mhc_cute.triton.configs import select_tactic

        return dict(select_tactic(*env.triton_device, m, h).__dict__)  # as the backend resolves None there
    return None


def _draw_call(rng: random.Random, env: Env, op: str, configure: Callable[[random.Random], tuple],
               h_multiple: Callable[[str, dict], int], seam: bool) -> dict:
    """What every op's call draws: a kernel configuration (``configure(rng)`` -> (its own fields, the backends to
    choose from); the backend, H, norm; for a seam the precision and a tactic), M, leading dims, the inputs' scale,
    outliers, zeros, gates, layout, ``out=`` buffers, a stream or a CUDA graph."""
    gpu = env.device == "cuda"
    history = env.history.setdefault(op, [])
    reuse = bool(history) and rng.random() >= env.new_config
    if reuse:
        config = dict(rng.choice(history))
    else:
        config, backends = configure(rng)
        backend = rng.choice(backends)
        mult = h_multiple(backend, config) if backend != "auto" else 64
        if rng.random() < 0.8:
            mult = max(mult, 64)
        max_h = 8192 if gpu else CPU_LIMITS["triton" if backend == "triton" else "torch"][1]
        config.update(backend=backend, h=mult * rng.randint(1, max(1, max_h // mult)),
                      norm=rng.choice([None, None, "bfloat16", "bfloat16", "float32"]))
        if seam:
            config["precision"] = rng.choice(["fp32", "fp32", "fp32", "tf32"])
    h = config["h"]
    if gpu:
        max_m = max(1, min(MAX_M_GPU, MAX_ELEMENTS_GPU // (4 * h)))
    else:
        max_m = CPU_LIMITS["triton" if config["backend"] == "triton" else "torch"][0]
    m = _draw_m(rng, max_m)
    if not reuse:
        if seam:
            config["tactic"] = _draw_tactic(rng, config["backend"], m, h, env)
        if env.new_config < 1:
            history.append(dict(config, tactic=_resolved_tactic(config["backend"], config["tactic"], m, h, env))
                           if seam else config)
    graph = gpu and m > 0 and rng.random() < 0.07
    return dict(
        op=op, **config, m=m, lead=_draw_lead(rng, m), seed=rng.randrange(1 << 31),
        scale=rng.choice(SCALES), outliers=rng.choice([0, 0, 1, 3]),
        zeros=rng.choice(["none", "none", "channels", "tokens", "post"]),
        gate_scale=rng.choice([0.5, 0.5, 0.5, 3.0, 100.0]),
        layout=rng.choice(["contiguous", "contiguous", "strided", "misaligned"]),
        out=rng.choice(["none", "none", "out", "flat-out"]),
        stream=gpu and not graph and rng.random() < 0.2, graph=graph,
    )


def _seam_h_multiple(backend: str, config: dict) -> int:
    from mhc_cute import BACKENDS

    return BACKENDS[backend].h_multiple_for(config.get("form", "regular"))


def _draw_form(rng: random.Random) -> str:
    """A seam form, the regular one half the time (every seam backend runs every form)."""
    return rng.choice(["regular", "regular", "no_post", "broadcast"])


def _embedding_lead(d: dict) -> dict:
    """A broadcast draw's leading dims: an embedding [..., 4, H] with a leading dim is 4 streams (the API's documented
    rule), so such a draw takes the flat [M, H]."""
    if d["form"] == "broadcast" and len(d["lead"]) > 1 and d["lead"][-1] == 4:
        d["lead"] = [d["m"]]
    return d


def draw_fused_hc(rng: random.Random, env: Env) -> dict:
    """A ``mhc_fused_hc`` call in one of its forms (regular, no post, broadcast entry)."""
    def configure(rng):
        return dict(form=_draw_form(rng)), env.backends

    d = _embedding_lead(_draw_call(rng, env, "mhc_fused_hc", configure, _seam_h_multiple, seam=True))
    d["poison"] = None
    if d["form"] == "regular" and d["m"] and not d["graph"] and rng.random() < POISON:  # the non-finite policy
        name, tail = rng.choice(list(POISON_TAILS.items()))
        d["poison"] = dict(name=name, token=rng.randrange(d["m"]), at=[rng.randrange(n if n else d["h"]) for n in tail],
                           value=rng.choice(["nan", "inf", "-inf"]))
    return d


def seam_inputs(d: dict, seed: int, device: str) -> dict:
    """The inputs a seam draw describes (``benchmark.make_sets``'s statistics, then its knobs), in its layout; for
    the delayed seam (``d["pre"]``) its form and ``pre_mix_prev`` (carried gates, or None for the identity)."""
    import torch

    from mhc_cute.benchmark import make_sets

    m, h, lead = d["m"], d["h"], tuple(d["lead"])
    s = make_sets(m, h, 1, device, d["norm"] is not None, seed)[0]
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x, res = s["x_prev"].float() * d["scale"], s["residual_prev"].float() * d["scale"]
    if d["outliers"]:
        ch = torch.randint(0, h, (d["outliers"],), generator=g, device=device)
        x[:, ch] *= 100
        res[:, :, ch] *= 100
    post = s["post_mix_prev"]
    if m and d["zeros"] == "channels":
        ch = torch.randint(0, h, (max(1, h // 16),), generator=g, device=device)
        x[:, ch] = 0
        res[:, :, ch] = 0
    elif m and d["zeros"] == "tokens":
        tok = torch.randint(0, m, (max(1, m // 4),), generator=g, device=device)
        x[tok] = 0
        res[tok] = 0
    elif m and d["zeros"] == "post":
        post = post.clone()
        post[torch.randint(0, m, (max(1, m // 4),), generator=g, device=device)] = 0
    inputs = dict(
        x_prev=x.bfloat16().reshape(*lead, h), residual_prev=res.bfloat16().reshape(*lead, 4, h),
        post_mix_prev=post.reshape(*lead, 4, 1), comb_mix_prev=s["comb_mix_prev"].reshape(*lead, 4, 4),
        fn=s["fn"], hc_scale=s["hc_scale"], hc_base=_gate_bases(s["hc_base"] / 0.5, d["gate_scale"]),
        norm_weight=None if d["norm"] is None else s["norm_weight"].to(getattr(torch, d["norm"])),
    )
    if d.get("pre") is not None:  # gates as a seam returns them: sigmoid + hc_pre_eps
        carried = torch.sigmoid(torch.randn(m, 4, generator=g, device=device)) + 1e-6
        inputs["pre_mix_prev"] = carried.reshape(*lead, 4) if d["pre"] == "carried" else None
    form = d.get("form", "regular")
    if form != "regular":
        inputs.update(x_prev=None, post_mix_prev=None, comb_mix_prev=None)
    if form == "broadcast":  # one stream: the pipeline entry's embedding
        inputs["residual_prev"] = inputs["residual_prev"][..., 0, :].contiguous()
    return _layout(inputs, d["layout"])


def _gate_bases(base, scale: float):
    """``hc_base`` (standard normal) times ``scale``; past 10, with signs alternating by column, as in the saturated
    gates test: every group keeps gates near 1 (a group whose gates all sit near 0 has a norm too small in fp32 for
    the contract's normwise comparison)."""
    import torch

    if scale <= 10:
        return base * scale
    signs = torch.tensor([1.0, -1.0] * 12, device=base.device)
    return base.abs() * scale * signs


def _layout(inputs: dict, layout: str) -> dict:
    """The activations as non-contiguous views (``strided``) or at a base 2 or 4 bytes past 16-byte alignment
    (``misaligned``), with the same values."""
    import torch

    if layout == "contiguous":
        return inputs
    out = dict(inputs)
    for k in ACTIVATIONS:
        t = inputs.get(k)
        if t is None:
            continue
        if layout == "strided":  # every other element of a tensor twice as wide in its last dim
            wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
            view = wide[..., ::2]
        else:
            flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
            view = flat[1:].view(t.shape)
        view.copy_(t)
        out[k] = view
    return out


def _flat(out, m: int, h: int):
    """A seam's outputs as ``[M, ...]`` (None stays None)."""
    shapes = ((m, 4, h), (m, 4, 1), (m, 4, 4), (m, h), (m, 4))
    return type(out)(*(None if t is None else t.reshape(shape) for t, shape in zip(out, shapes)))


def _seam_shapes(d: dict) -> list:
    """A seam's output shapes (``out=``'s flat alternatives with ``flat-out``; the delayed seam's ``pre_mix_cur``
    last, None for the residual of a seam without post)."""
    lead, h = tuple(d["lead"]), d["h"]
    flat = d["out"] == "flat-out"
    shapes = [None if d.get("form") == "no_post" else (*lead, 4, h), (*lead, 4) if flat else (*lead, 4, 1),
              (*lead, 16) if flat else (*lead, 4, 4), (*lead, h)]
    if d["op"] == "mhc_fused_hc_delayed":
        shapes.append((*lead, 4, 1) if flat else (*lead, 4))
    return shapes


def _nan_buffers(shapes: list, dtypes: list, device: str) -> tuple:
    import torch

    return tuple(None if s is None else torch.full(s, float("nan"), dtype=t, device=device)
                 for s, t in zip(shapes, dtypes))


def _tactic_object(d: dict):
    if isinstance(d["tactic"], dict):
        from mhc_cute.triton.configs import TritonTactic

        return TritonTactic(**d["tactic"])
    return d["tactic"]


def _run_call(d: dict, env: Env, make: Callable, call: Callable, check: Callable, buffers) -> tuple | None:
    """Inputs ``make(seed)``, ``call(inputs)`` on the current stream, a second stream, or captured in a CUDA graph
    and replayed on two new sets of activations (the weights kept: a layer's graph), each output checked
    (``check(out, inputs)``); returns the eager call's ``(inputs, out)``, None for a graph."""
    import torch

    device = env.device
    inputs = make(d["seed"])
    if d["graph"]:
        from mhc_cute.benchmark import capture

        static, captured = dict(inputs), []
        graph = capture(lambda s: captured.append(call(s)), [static])
        for i in range(2):
            fresh = make(d["seed"] + 7 + i)
            for k in ACTIVATIONS + OP_ACTIVATIONS:
                if static.get(k) is not None:
                    static[k].copy_(fresh[k])
            for b in buffers or ():
                if b is not None:
                    b.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check(captured[-1], static)
        return None
    if d["stream"]:
        env.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(env.stream):
            out = call(inputs)
        torch.cuda.current_stream().wait_stream(env.stream)
    else:
        out = call(inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    check(out, inputs)
    return inputs, out


def _run_seam(d: dict, env: Env, fn: Callable) -> tuple | None:
    """One call of the seam ``fn`` as ``d`` describes it, checked against the contract (``_run_call``)."""
    import torch

    from mhc_cute.accuracy import check_outputs, problem_of, tolerances

    m, h = d["m"], d["h"]
    shapes = _seam_shapes(d)
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32]
    buffers = _nan_buffers(shapes, dtypes, env.device) if d["out"] != "none" else None
    kwargs = dict(backend=d["backend"], precision=d["precision"], tactic=_tactic_object(d))

    def call(s):
        return fn(**s, **kwargs, out=buffers)

    def check(out, s):
        if d.get("form") == "no_post":  # the op returns residual_prev itself, out= or not
            assert out.residual_cur is s["residual_prev"], "residual_cur: not residual_prev itself (no post)"
            out = out._replace(residual_cur=None)
        want = [None if t is None else list(t) for t in shapes]
        if buffers is not None:
            assert all(a is b for a, b in zip(out, buffers)), "out=: the returned tensors are not the buffers"
        got = [None if t is None else list(t.shape) for t in out]
        assert got == want, f"output shapes {got} != {want}"
        backend = d["backend"] if d["backend"] != "auto" else "half_mma"  # the loosest tolerances auto may need
        check_outputs(_flat(out, m, h), problem_of(s, d["precision"]), **tolerances(backend, d["precision"]))

    return _run_call(d, env, lambda seed: seam_inputs(d, seed, env.device), call, check, buffers)


def run_fused_hc(d: dict, env: Env) -> None:
    import mhc_cute
    from mhc_cute.accuracy import check_poisoned_token, problem_of

    done = _run_seam(d, env, mhc_cute.mhc_fused_hc)
    if done is not None and d.get("poison"):
        inputs, out = done
        m, h = d["m"], d["h"]
        clean = _flat(type(out)(*(t.clone() for t in out)), m, h)
        bad = _poisoned(inputs, d["poison"], m)
        kwargs = dict(backend=d["backend"], precision=d["precision"], tactic=_tactic_object(d))
        poisoned = mhc_cute.mhc_fused_hc(**bad, **kwargs, out=None if d["out"] == "none" else out)
        check_poisoned_token(_flat(poisoned, m, h), clean, problem_of(bad, d["precision"]), d["poison"]["token"])


def _poisoned(inputs: dict, p: dict, m: int) -> dict:
    """``inputs`` with one value of one token non-finite (``gpu_nan`` for NaN)."""
    import torch

    from mhc_cute.accuracy import gpu_nan

    t = inputs[p["name"]]
    flat = t.reshape(m, *t.shape[len(t.shape) - len(POISON_TAILS[p["name"]]):]).clone()
    value = gpu_nan(t.dtype) if p["value"] == "nan" else torch.tensor(float(p["value"]), dtype=t.dtype)
    flat[(p["token"], *p["at"])] = value.to(t.device)
    return dict(inputs, **{p["name"]: flat.reshape(t.shape)})


def label_backend(d: dict) -> str:
    return d["backend"]


def label_seam(d: dict) -> str:
    return f"{d['backend']}/{d.get('form', 'regular')}"


# --- mhc_fused_hc_delayed -------------------------------------------------------------------------------------

def draw_fused_hc_delayed(rng: random.Random, env: Env) -> dict:
    """A ``mhc_fused_hc`` draw plus the seam's form and its carried gates (``pre_mix_prev`` None: the identity)."""
    def configure(rng):
        return dict(form=_draw_form(rng), pre=rng.choice(["carried", "carried", "identity"])), env.backends

    return _embedding_lead(_draw_call(rng, env, "mhc_fused_hc_delayed", configure, _seam_h_multiple, seam=True))


def run_fused_hc_delayed(d: dict, env: Env) -> None:
    import mhc_cute

    _run_seam(d, env, mhc_cute.mhc_fused_hc_delayed)


# --- the standalone ops (``mhc_cute.ops``) ----------------------------------------------------------------------

def draw_standalone(op: str) -> Callable[[random.Random, Env], dict]:
    from mhc_cute import ops

    return lambda rng, env: _draw_call(rng, env, op, lambda rng: ({}, env.op_backends[op]),
                                       lambda b, config: ops.OP_BACKENDS[op][b].h_multiple, seam=False)


def run_standalone(d: dict, env: Env) -> None:
    """One call of a standalone op: its inputs from the seam's (``accuracy.op_inputs_of``, carried gates for
    ``mhc_collapse``), checked with ``accuracy.check_op_output``."""
    import torch

    from mhc_cute.accuracy import call_op, check_op_output, op_inputs_of, op_tolerances

    op = d["op"]
    lead, h = tuple(d["lead"]), d["h"]
    shape = (*lead, 4, h) if op == "mhc_post" else (*lead, h)
    buffers = _nan_buffers([shape], [torch.bfloat16], env.device) if d["out"] != "none" else None

    def check(out, s):
        if buffers is not None:
            assert out is buffers[0], "out=: the returned tensor is not the buffer"
        assert tuple(out.shape) == shape, f"output shape {tuple(out.shape)} != {shape}"
        check_op_output(op, out, s, **op_tolerances(op, d["backend"]))

    _run_call(d, env, lambda seed: op_inputs_of(op, seam_inputs(dict(d, pre="carried"), seed, env.device)),
              lambda s: call_op(op, s, d["backend"], None if buffers is None else buffers[0]), check, buffers)


OPS: dict[str, SoakOp] = {
    "mhc_fused_hc": SoakOp(draw_fused_hc, run_fused_hc, label_seam, weight=4),
    "mhc_fused_hc_delayed": SoakOp(draw_fused_hc_delayed, run_fused_hc_delayed, label_seam, weight=3),
    **{op: SoakOp(draw_standalone(op), run_standalone, label_backend)
       for op in ("mhc_post", "mhc_collapse", "mhc_head")},
}


# --- the loop -------------------------------------------------------------------------------------------------------

def make_env(device: str | None, backends: list | None, new_config: float | None) -> Env:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton kernels are decorated (first use)
        # saturated gates and non-finite inputs: the interpreter's numpy warns where IEEE arithmetic gives an infinity
        # or NaN, as intended
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton|numpy")
    from mhc_cute import available, ops

    env = _backend_env(device, available(torch.device(device)),
                       {op: ops.available(op, torch.device(device)) for op in ops.OP_BACKENDS}, backends)
    if "triton" in env.backends:
        from mhc_cute.triton import fused_hc

        env.triton_device = fused_hc.device_key(torch.device(device))
    if device == "cuda":
        env.new_config = NEW_CONFIG_GPU if new_config is None else new_config
        env.sm_count = torch.cuda.get_device_properties(0).multi_processor_count
        env.stream = torch.cuda.Stream()
    elif new_config is not None:
        env.new_config = new_config
    return env


def hopper_env(backends: list | None, new_config: float | None, sm_count: int) -> Env:
    """The ``Env`` that ``make_env`` builds on a Hopper GPU with ``sm_count`` SMs, where every backend runs, made
    without one: its draws are the soak's there (``--precompile-only``)."""
    from mhc_cute import BACKENDS, ops

    env = _backend_env("cuda", list(BACKENDS), {op: list(ops.OP_BACKENDS[op]) for op in ops.OP_BACKENDS}, backends)
    env.new_config = NEW_CONFIG_GPU if new_config is None else new_config
    env.sm_count = sm_count
    env.triton_device = ("sm90", sm_count)
    return env


def _backend_env(device: str, seam_backends: list, op_backends: dict, backends: list | None) -> Env:
    """An ``Env`` of the seam's and each op's backends that run on ``device`` (in the registries' order, which the
    draws depend on; ``auto`` too on a GPU), kept to ``backends`` when given."""
    auto = ["auto"] if device == "cuda" else []
    names = [b for b in seam_backends + auto if not backends or b in backends]
    if not names:
        raise SystemExit(f"no backend to soak on {device} (available: {seam_backends + auto})")
    return Env(device, names, {op: [b for b in here + auto if not backends or b in backends]
                               for op, here in op_backends.items()})


def call_rng(seed: int, i: int) -> random.Random:
    return random.Random(seed * 1_000_003 + i)


def failure_text(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def is_fatal(env: Env) -> bool:
    """Whether the CUDA context is unusable (a sticky error): nothing more can run in this process."""
    if env.device != "cuda":
        return False
    import torch

    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001
        return True


def _main_thread_stack(frames: int = 8) -> str:
    """The main thread's innermost ``frames`` frames, indented (read from another thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "  (no stack)"
    return "".join(traceback.format_stack(frame)[-frames:]).rstrip()


class Watchdog:
    """Reports the call in flight (with its reproducer) once it has run ``slow_s`` seconds, and after ``hang_s``
    counts it as hung: prints the last line and ends the process with status 1 (a hang must not eat the run)."""

    def __init__(self, slow_s: float, hang_s: float, device: str, on_hang=lambda: os._exit(1)):
        self.slow_s, self.hang_s, self.device, self.on_hang = slow_s, hang_s, device, on_hang
        self.current = None  # (call index, draw, start time, calls so far, failures so far)
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def start(self, i: int, d: dict, calls: int, failures: int) -> None:
        with self.lock:
            self.current = (i, d, time.monotonic(), calls, failures)

    def stop(self) -> None:
        """The soak is over: no call is in flight any more (a process that goes on, a test session, must not be
        ended by a stale one)."""
        self.stopped.set()

    def _watch(self) -> None:
        reported = None
        while not self.stopped.wait(1):
            with self.lock:
                if self.current is None:
                    continue
                i, d, t0, calls, failures = self.current
            ran = time.monotonic() - t0
            line = f"--device {self.device} --replay '{json.dumps(d)}'"
            if ran >= self.hang_s:
                print(f"FAIL call {i}: hung ({ran:.0f} s)\n  reproduce: python bench/soak.py {line}\n"
                      f"soak: {calls + 1} calls, {failures + 1} failures", flush=True)
                self.on_hang()
                return
            if ran >= self.slow_s and reported != i:
                reported = i
                print(f"slow call {i}: {ran:.0f} s so far; python bench/soak.py {line}", flush=True)
                print(_main_thread_stack(), flush=True)  # where it waits: compile, launch, synchronize


def draw_sequence(seed: int, env: Env, ops: list[str]):
    """The soak's calls in order, ``(i, op, draw)``: the i-th depends only on the seed, i and the draws before it
    (the kernel configurations they drew, in ``env.history``)."""
    weights = [OPS[o].weight for o in ops]
    for i in itertools.count():
        rng = call_rng(seed, i)
        op = rng.choices(ops, weights)[0]
        yield i, op, OPS[op].draw(rng, env)


SEAM_OPS = ("mhc_fused_hc", "mhc_fused_hc_delayed")


def kernel_specs(seed: int, env: Env, ops: list[str], calls: int) -> tuple[list, list]:
    """(FMA specs, MMA specs), in ``bench/precompile.py``'s form, of the CuTe seam kernels that the first ``calls``
    calls of the soak launch (a draw's tactic, or its backend's default at the draw's M on ``env.sm_count`` SMs).
    ``auto`` draws (resolved by the GPU's tables) and the standalone ops' kernels are left to compile on first use."""
    call_specs = precompile_script.call_specs
    fma, mma = [], []
    for _, op, d in itertools.islice(draw_sequence(seed, env, ops), calls):
        if op in SEAM_OPS and d["m"]:
            f, m = call_specs(d["backend"], d["tactic"], d["m"], d["h"], d["norm"], d["precision"], d.get("pre"),
                              d.get("form", "regular"), env.sm_count)
            fma += f
            mma += m
    return list(dict.fromkeys(fma)), list(dict.fromkeys(mma))


def soak(seconds: float, seed: int, env: Env, ops: list[str], progress_s: float, hang_s: float = 600) -> int:
    start = last = time.monotonic()
    calls, failures, counts = 0, [], {}
    watchdog = Watchdog(min(60.0, hang_s), hang_s, env.device)
    draws = draw_sequence(seed, env, ops)
    try:
        while time.monotonic() - start < seconds:
            i, op, d = next(draws)
            watchdog.start(i, d, calls, len(failures))
            try:
                OPS[op].run(d, env)
            except Exception as e:  # noqa: BLE001 - every failure is reported with its reproducer
                failures.append((i, d, failure_text(e)))
                print(f"FAIL call {i}: {failure_text(e)}", flush=True)
                if is_fatal(env):
                    print("the CUDA context is unusable: stopping", flush=True)
                    calls += 1
                    break
            calls += 1
            key = f"{op}:{OPS[op].label(d)}"
            counts[key] = counts.get(key, 0) + 1
            if time.monotonic() - last >= progress_s:
                last = time.monotonic()
                print(f"soak: {last - start:.0f} s, {calls} calls, {len(failures)} failures  "
                      + " ".join(f"{k}={v}" for k, v in sorted(counts.items())), flush=True)
    finally:
        watchdog.stop()
    for i, d, text in failures:
        print(f"\nfailure at call {i} (--seed {seed}): {text}\n  reproduce: python bench/soak.py "
              f"--device {env.device} --replay '{json.dumps(d)}'")
    print("calls by op and backend: " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    print(f"soak: {calls} calls, {len(failures)} failures")
    return 1 if failures else 0


def precompile(seed: int, env: Env, ops: list[str], calls: int, workers: int) -> int:
    """Compile the kernels of ``kernel_specs`` (``--precompile-only``)."""
    fma_specs, mma_specs = kernel_specs(seed, env, [o for o in ops if env.op_backends.get(o, True)], calls)
    print(f"soak seed {seed}, {calls} calls on {env.sm_count} SMs: {len(fma_specs)} FMA and {len(mma_specs)} MMA "
          f"variants", flush=True)
    precompile_script.compile_seam_kernels(fma_specs, mma_specs, workers)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when there is a GPU")
    ap.add_argument("--backends", help="comma-separated (default: every one that runs here, and auto on a GPU)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {','.join(OPS)}")
    ap.add_argument("--progress", type=float, default=10, help="seconds between progress lines")
    ap.add_argument("--new-config", type=float, help=f"share of draws with a new kernel configuration, the others "
                    f"reuse an earlier one with new sizes and data (default: {NEW_CONFIG_GPU} on a GPU, 1 on the CPU)")
    ap.add_argument("--replay", help="one call: a draw as a failure printed it (JSON)")
    ap.add_argument("--hang-after", type=float, default=600, help="seconds after which a call in flight counts as "
                    "hung: its reproducer is printed and the soak ends with status 1 (calls past a minute are "
                    "reported as slow)")
    ap.add_argument("--precompile-only", action="store_true", help="no GPU needed: compile into "
                    "$MHC_CUTE_KERNEL_CACHE the CuTe seam kernels of the first --calls calls that --seed draws on a "
                    "Hopper GPU with --sm-count SMs, so that the soak there spends its time calling")
    ap.add_argument("--calls", type=int, default=3000, help="with --precompile-only (a GPU makes 5-10 calls a second)")
    ap.add_argument("--sm-count", type=int, default=132, help="with --precompile-only (H100/H200 SXM: 132)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="with --precompile-only")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("MHC_CUTE_KERNEL_CACHE", DEFAULT_KERNEL_CACHE)
    backends = args.backends and args.backends.split(",")
    if args.precompile_only:
        if args.seed is None:
            ap.error("--precompile-only needs the --seed of the soak it prepares")
        return precompile(args.seed, hopper_env(backends, args.new_config, args.sm_count), args.ops.split(","),
                          args.calls, args.workers)
    env = make_env(args.device, backends, args.new_config)
    if args.replay:
        d = json.loads(args.replay)
        try:
            OPS[d["op"]].run(d, env)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL: {failure_text(e)}")
            print("soak: 1 calls, 1 failures")
            return 1
        print("soak: 1 calls, 0 failures")
        return 0
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    print(f"soak seed {seed} on {env.device}: {', '.join(env.backends)}", flush=True)
    ops = [o for o in args.ops.split(",") if env.op_backends.get(o, True)]
    if not ops:
        raise SystemExit(f"no op to soak on these backends: {args.ops}")
    return soak(args.seconds, seed, env, ops, args.progress, args.hang_after)


if __name__ == "__main__":
    sys.exit(main())
