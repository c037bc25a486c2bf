"""A randomized soak: calls with random shapes, backends, tactics, precisions, input scales, layouts, output buffers,
streams and CUDA graphs, each checked against the float64 contract (``mhc_cute.accuracy``); exit status 1 on any
failure, each with a command that reproduces it.

    bash .devbundle/gpu.sh python bench/soak.py --seconds 540 --seed 1
    python bench/soak.py --seconds 40          # no GPU: the torch backend and Triton's interpreter, small shapes
    python bench/soak.py --replay '{"op": "mhc_fused_hc", ...}'   # one call again, as a failure printed it

Each call of ``mhc_fused_hc`` draws: M (0, 1, powers of two, odd sizes, any size; up to tens of thousands on a GPU,
bounded by ``MAX_ELEMENTS_GPU`` elements of ``residual_prev``), H (multiples of 64 up to 8192, or of the backend's
``h_multiple``), a backend (``auto`` and ``torch`` included) and a tactic (its default, a candidate the tuner times,
the most K splits, for Triton other K splits and chunks), the norm (none, bf16 or fp32 weight), the precision, the
inputs' scale (1e-20 to 1e10) with outlier channels (x100) and exact zeros (channels, tokens, post gates), the
gates' saturation (``hc_base`` up to 100), leading dims, non-contiguous or misaligned inputs, ``out=`` buffers
(poisoned with NaN; the flat alternative shapes too), and on a GPU a second stream, or a CUDA graph captured and
replayed on two new sets of activations. Now and then the call is made again with a NaN or an infinity in one value
of one token, against the non-finite policy (``accuracy.check_poisoned_token``). On a GPU most draws reuse the
kernel configuration of an earlier one (its backend, H, norm, precision and resolved tactic) with new sizes and
data, so that compiling new kernel variants takes a bounded share of the run (``$MHC_CUTE_KERNEL_CACHE``, default
/tmp/mhc-kcache, keeps them for later runs).
A call's draw is a JSON object; the i-th draw depends only on ``--seed`` and i. A new op is one entry of ``OPS``
(its draw and its run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
MAX_ELEMENTS_GPU = 300_000_000  # M * 4H on a GPU: the float64 check's temporaries stay within tens of GB
MAX_M_GPU = 65536
CPU_LIMITS = {"torch": (32, 768), "triton": (6, 256)}  # (largest M, largest H) without a GPU: seconds per call
NEW_CONFIG_GPU = 0.02  # share of GPU draws with a new kernel configuration (a compile, seconds, for most)
SCALES = (1e-20, 1e-4, 1.0, 1e3, 1e10)  # the activations' scale; with x100 outliers every fp32 sum stays finite
POISON = 0.05  # share of calls made again with a NaN or an infinity in one token (``accuracy.check_poisoned_token``)
POISON_TAILS = {"x_prev": (0,), "residual_prev": (4, 0), "post_mix_prev": (4, 1), "comb_mix_prev": (4, 4)}  # 0: H
DEFAULT_KERNEL_CACHE = "/tmp/mhc-kcache"


@dataclass
class Env:
    """What draws depend on: the device, the backends that run there, and the kernel configurations drawn so far."""

    device: str
    backends: list
    new_config: float = 1.0  # share of draws with a new kernel configuration; the others reuse one of ``history``
    sm_count: int = 132
    history: list = field(default_factory=list)
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

        table = configs.table_for("sm90" if env.device == "cuda" else "interpreter")
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
        import torch

        from mhc_cute.triton import fused_hc

        return dict(fused_hc._default_tactic(torch.device(env.device), m, h).__dict__)
    return None


def draw_fused_hc(rng: random.Random, env: Env) -> dict:
    from mhc_cute import BACKENDS

    gpu = env.device == "cuda"
    reuse = bool(env.history) and rng.random() >= env.new_config
    if reuse:
        config = dict(rng.choice(env.history))
    else:
        backend = rng.choice(env.backends)
        mult = BACKENDS[backend].h_multiple if backend != "auto" else 64
        if rng.random() < 0.8:
            mult = max(mult, 64)
        max_h = 8192 if gpu else CPU_LIMITS["triton" if backend == "triton" else "torch"][1]
        config = dict(backend=backend, h=mult * rng.randint(1, max(1, max_h // mult)),
                      norm=rng.choice([None, None, "bfloat16", "bfloat16", "float32"]),
                      precision=rng.choice(["fp32", "fp32", "fp32", "tf32"]))
    h = config["h"]
    if gpu:
        max_m = max(1, min(MAX_M_GPU, MAX_ELEMENTS_GPU // (4 * h)))
    else:
        max_m = CPU_LIMITS["triton" if config["backend"] == "triton" else "torch"][0]
    m = _draw_m(rng, max_m)
    if not reuse:
        config["tactic"] = _draw_tactic(rng, config["backend"], m, h, env)
        if env.new_config < 1:
            env.history.append(dict(config, tactic=_resolved_tactic(config["backend"], config["tactic"], m, h, env)))
    graph = gpu and m > 0 and rng.random() < 0.07
    poison = None
    if m and not graph and rng.random() < POISON:  # one value of one token: the non-finite policy
        name, tail = rng.choice(list(POISON_TAILS.items()))
        poison = dict(name=name, token=rng.randrange(m), at=[rng.randrange(n if n else h) for n in tail],
                      value=rng.choice(["nan", "inf", "-inf"]))
    return dict(
        op="mhc_fused_hc", **config, m=m, lead=_draw_lead(rng, m), seed=rng.randrange(1 << 31),
        scale=rng.choice(SCALES), outliers=rng.choice([0, 0, 1, 3]),
        zeros=rng.choice(["none", "none", "channels", "tokens", "post"]),
        gate_scale=rng.choice([0.5, 0.5, 0.5, 3.0, 100.0]),
        layout=rng.choice(["contiguous", "contiguous", "strided", "misaligned"]),
        out=rng.choice(["none", "none", "out", "flat-out"]),
        stream=gpu and not graph and rng.random() < 0.2, graph=graph, poison=poison,
    )


def fused_hc_inputs(d: dict, seed: int, device: str) -> dict:
    """The inputs a draw describes (``benchmark.make_sets``'s statistics, then its knobs), in its layout."""
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
    for k in ("x_prev", "residual_prev", "post_mix_prev", "comb_mix_prev"):
        t = inputs[k]
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
    from mhc_cute import MhcFusedHcOutput

    return MhcFusedHcOutput(out[0].reshape(m, 4, h), out[1].reshape(m, 4, 1), out[2].reshape(m, 4, 4),
                            out[3].reshape(m, h))


def _out_buffers(d: dict, device: str):
    import torch

    lead, h = tuple(d["lead"]), d["h"]
    flat = d["out"] == "flat-out"
    shapes = [(*lead, 4, h), (*lead, 4) if flat else (*lead, 4, 1), (*lead, 16) if flat else (*lead, 4, 4),
              (*lead, h)]
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    return tuple(torch.full(s, float("nan"), dtype=t, device=device) for s, t in zip(shapes, dtypes))


def _tactic_object(d: dict):
    if isinstance(d["tactic"], dict):
        from mhc_cute.triton.configs import TritonTactic

        return TritonTactic(**d["tactic"])
    return d["tactic"]


def run_fused_hc(d: dict, env: Env) -> None:
    import torch

    import mhc_cute
    from mhc_cute.accuracy import check_outputs, check_poisoned_token, problem_of, tolerances

    device, m, h = env.device, d["m"], d["h"]
    inputs = fused_hc_inputs(d, d["seed"], device)
    buffers = _out_buffers(d, device) if d["out"] != "none" else None
    kwargs = dict(backend=d["backend"], precision=d["precision"], tactic=_tactic_object(d))

    def call(s):
        return mhc_cute.mhc_fused_hc(**s, **kwargs, out=buffers)

    def check(out, s):
        lead = tuple(d["lead"])
        want = [(*lead, 4, h), (*lead, 4, 1), (*lead, 4, 4), (*lead, h)]
        if buffers is not None:
            assert all(a is b for a, b in zip(out, buffers)), "out=: the returned tensors are not the buffers"
            want = [tuple(b.shape) for b in buffers]
        assert [tuple(t.shape) for t in out] == want, f"output shapes {[tuple(t.shape) for t in out]} != {want}"
        backend = d["backend"] if d["backend"] != "auto" else "half_mma"  # the loosest tolerances auto may need
        check_outputs(_flat(out, m, h), problem_of(s, d["precision"]), **tolerances(backend, d["precision"]))

    if d["graph"]:
        from mhc_cute.benchmark import capture

        static, captured = dict(inputs), []
        graph = capture(lambda s: captured.append(call(s)), [static])
        for i in range(2):  # new activations copied in, the weights kept (a layer's graph)
            fresh = fused_hc_inputs(d, d["seed"] + 7 + i, device)
            for k in ("x_prev", "residual_prev", "post_mix_prev", "comb_mix_prev"):
                static[k].copy_(fresh[k])
            if buffers is not None:
                for b in buffers:
                    b.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check(captured[-1], static)
        return
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
    if d.get("poison"):
        clean = _flat([t.clone() for t in out], m, h)
        bad = _poisoned(inputs, d["poison"], m)
        check_poisoned_token(_flat(call(bad), m, h), clean, problem_of(bad, d["precision"]), d["poison"]["token"])


def _poisoned(inputs: dict, p: dict, m: int) -> dict:
    """``inputs`` with one value of one token non-finite (``gpu_nan`` for NaN)."""
    import torch

    from mhc_cute.accuracy import gpu_nan

    t = inputs[p["name"]]
    flat = t.reshape(m, *t.shape[len(t.shape) - len(POISON_TAILS[p["name"]]):]).clone()
    value = gpu_nan(t.dtype) if p["value"] == "nan" else torch.tensor(float(p["value"]), dtype=t.dtype)
    flat[(p["token"], *p["at"])] = value.to(t.device)
    return dict(inputs, **{p["name"]: flat.reshape(t.shape)})


def label_fused_hc(d: dict) -> str:
    return d["backend"]


OPS: dict[str, SoakOp] = {
    "mhc_fused_hc": SoakOp(draw_fused_hc, run_fused_hc, label_fused_hc),
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
    from mhc_cute import available

    here = available(torch.device(device)) + (["auto"] if device == "cuda" else [])
    names = [b for b in here if not backends or b in backends]
    if not names:
        raise SystemExit(f"no backend to soak on {device} (available: {here})")
    env = Env(device, names)
    if device == "cuda":
        env.new_config = NEW_CONFIG_GPU if new_config is None else new_config
        env.sm_count = torch.cuda.get_device_properties(0).multi_processor_count
        env.stream = torch.cuda.Stream()
    elif new_config is not None:
        env.new_config = new_config
    return env


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


def soak(seconds: float, seed: int, env: Env, ops: list[str], progress_s: float) -> int:
    weights = [OPS[o].weight for o in ops]
    start = last = time.monotonic()
    calls, failures, counts = 0, [], {}
    i = 0
    while time.monotonic() - start < seconds:
        rng = call_rng(seed, i)
        op = rng.choices(ops, weights)[0]
        d = OPS[op].draw(rng, env)
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
        i += 1
        key = f"{op}:{OPS[op].label(d)}"
        counts[key] = counts.get(key, 0) + 1
        if time.monotonic() - last >= progress_s:
            last = time.monotonic()
            print(f"soak: {last - start:.0f} s, {calls} calls, {len(failures)} failures  "
                  + " ".join(f"{k}={v}" for k, v in sorted(counts.items())), flush=True)
    for i, d, text in failures:
        print(f"\nfailure at call {i} (--seed {seed}): {text}\n  reproduce: python bench/soak.py "
              f"--device {env.device} --replay '{json.dumps(d)}'")
    print("calls by op and backend: " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    print(f"soak: {calls} calls, {len(failures)} failures")
    return 1 if failures else 0


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
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("MHC_CUTE_KERNEL_CACHE", DEFAULT_KERNEL_CACHE)
    env = make_env(args.device, args.backends and args.backends.split(","), args.new_config)
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
    return soak(args.seconds, seed, env, args.ops.split(","), args.progress)


if __name__ == "__main__":
    sys.exit(main())
