"""Side-by-side timing of mhc_cute's backends and its peers (``mhc-cute bench``, ``bench/``).

Method (see the README): each timed call rotates among enough distinct input and weight sets that nothing sits
in L2 between calls, as consecutive layers behave in a real model. "graph" times are CUDA-graph replays of one
call per set (device time per call, launch gaps hidden); "eager" times are wall time per call of a plain Python
loop (what an engine without graphs pays, host overhead included). Each is the median of several repeats. The
floor is SPEC's cost model, ``((20H + 160) M + 384H) / B`` (``floor_bytes``; the other ops' floors beside it),
with B the copy bandwidth measured in the same run.

The CuTe paths launch with programmatic dependent launch (PDL): in back-to-back calls each call's first kernel
starts, and loads its weights, while the previous call's last kernel finishes. In a model another kernel runs
before each call: one that does not trigger PDL (most torch ops) removes that overlap, and the sublayer's output
projection (a cuBLAS GEMM, which at small M triggers PDL) lets the call start before it ends. So up to
``CONTEXT_MAX_M`` the benchmark also times each call in those two contexts (``context_predecessors``): what it adds
after the kernel before it, from CUPTI kernel timestamps (``time_after``); the tuner ranks those buckets by the worst
of the three (``autotune.worst_context``). ``time_graph_separated`` is the older, noisier graph-difference measure
(a graph of call + separator minus a graph of separators), kept for the probes.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple

import torch

from . import ops
from .accuracy import call_op, make_op_inputs, op_inputs_of, problem_of
from .api import mhc_fused_hc, mhc_fused_hc_delayed, prepared_launch
from .kernels.launch import OUTPUT_ARGS, PRE_MIX_CUR_ARG, KernelLaunch
from .model import HeadWeights, SublayerWeights, mhc_forward_v4, mhc_forward_v41
from .problem import MhcFusedHcOutput
from .reference import sinkhorn
from .selector import SELECTOR
from .version import dist_version

BENCH_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # the default grid of M
L2_FLUSH_BYTES = 256 << 20  # rotate through at least this much data (several times a Hopper L2)
MAX_SETS = 64
REPLAY_BATCH = 4  # graph replays enqueued together: the host's launch of each (~10 µs) hidden behind the one before
CONTEXT_MAX_M = 128  # up to here a call's time depends on the kernel before it (PDL): timed in context too
CONTEXTS = ("after-kernel", "after-gemm")  # the keys of ``context_predecessors``, in table order
NORM_DTYPE = "bfloat16"  # the fused-norm weight of the timed input sets (the dtype name the kernels compile for)


@dataclass
class Result:
    name: str
    m: int
    hidden: int
    graph_us: float | None = None
    context_us: dict = field(default_factory=dict)  # {context name: time_after µs} (``context_predecessors``)
    eager_us: float | None = None
    floor_frac: float | None = None  # floor time / graph time
    host: dict = field(default_factory=dict)  # auto: ``host_times`` as a dict (host µs per eager call and its floor)
    error: str | None = None
    extra: dict = field(default_factory=dict)


# SPEC's cost models: the bytes one call must move at the least for M tokens at hidden size H (per-token reads and
# writes, plus a weight read once per call); the floor time is that over the copy bandwidth.
WEIGHT_BYTES_PER_H = 24 * 4 * 4  # fn [24, 4H] fp32: 384H
BROADCAST_WEIGHT_BYTES_PER_H = 24 * 4  # fn_b [24, H] fp32 (the entry seam's folded weight): 96H
HEAD_WEIGHT_BYTES_PER_H = 4 * 4 * 4  # head_fn [4, 4H] fp32: 64H


def floor_bytes(m: int, hidden: int) -> int:
    """``mhc_fused_hc``: read x_prev (2H) and residual_prev (8H), write residual_cur (8H) and layer_input (2H), 160
    bytes of mixes in and out per token; the weight."""
    return (20 * hidden + 160) * m + WEIGHT_BYTES_PER_H * hidden


def delayed_floor_bytes(m: int, hidden: int) -> int:
    """``mhc_fused_hc_delayed``: the seam's bytes plus the carried and the returned pre gates (32 per token)."""
    return (20 * hidden + 192) * m + WEIGHT_BYTES_PER_H * hidden


def entry_floor_bytes(m: int, hidden: int) -> int:
    """The entry seam with broadcast: read the embedding (2H), write the 4 streams (8H) and layer_input (2H); the
    folded weight fn_b."""
    return 12 * hidden * m + BROADCAST_WEIGHT_BYTES_PER_H * hidden


def no_post_floor_bytes(m: int, hidden: int) -> int:
    """The no-post seam: read residual_prev (8H), write layer_input (2H); the weight."""
    return 10 * hidden * m + WEIGHT_BYTES_PER_H * hidden


def post_floor_bytes(m: int, hidden: int) -> int:
    """``mhc_post``: read x (2H), residual (8H) and 80 bytes of mixes, write residual_cur (8H); no weight."""
    return (18 * hidden + 80) * m


def collapse_floor_bytes(m: int, hidden: int) -> int:
    """``mhc_collapse``: read residual (8H) and the 4 gates (16 bytes), write layer_input (2H); no weight."""
    return (10 * hidden + 16) * m


def head_floor_bytes(m: int, hidden: int) -> int:
    """``mhc_head``: read residual (8H), write the output (2H), re-read residual for the collapse (8H: its gates
    depend on the full projection); the head weight."""
    return 18 * hidden * m + HEAD_WEIGHT_BYTES_PER_H * hidden


def measure_copy_bandwidth(device, nbytes: int = 2 << 30, reps: int = 40) -> float:
    """Bytes read + written per second of a large device-to-device copy: its fastest batch (the rate this GPU
    reaches, so that a fraction of the floor at this rate is not flattered by a slow sample)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    times = launch_us(lambda: dst.copy_(src), reps, REPLAY_BATCH)  # batched, as the replays it is compared with
    del src, dst
    return nbytes / (times[0] * 1e-6)


def n_rotation_sets(m: int, hidden: int) -> int:
    return max(2, min(MAX_SETS, math.ceil(L2_FLUSH_BYTES / floor_bytes(m, hidden))))


def rotated_sets(m: int, hidden: int, device, norm: bool = False) -> list[dict]:
    """As many input sets as a timed run rotates through so that nothing stays in L2 (``n_rotation_sets``)."""
    return make_sets(m, hidden, n_rotation_sets(m, hidden), device, norm)


def make_sets(m: int, hidden: int, n: int, device, norm: bool, seed: int = 0) -> list[dict]:
    """``n`` independent input + weight sets (random, never zeros)."""
    g = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(n):
        def randn(*s):
            return torch.randn(*s, generator=g, device=device)
        sets.append(dict(
            x_prev=randn(m, hidden).bfloat16(),
            residual_prev=randn(m, 4, hidden).bfloat16(),
            post_mix_prev=torch.sigmoid(randn(m, 4, 1)) * 2,
            comb_mix_prev=sinkhorn(randn(m, 4, 4), 1e-6, 20),
            fn=randn(24, 4 * hidden) / math.sqrt(4 * hidden),
            hc_scale=torch.rand(3, generator=g, device=device) + 0.5,
            hc_base=randn(24) * 0.5,
            norm_weight=(1 + 0.1 * randn(hidden)).to(getattr(torch, NORM_DTYPE)) if norm else None,
        ))
    return sets


def capture(call: Callable[[dict], object], sets: list[dict]) -> torch.cuda.CUDAGraph:
    """A CUDA graph that makes one call per set (each set warmed outside the capture first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets:  # warm every set outside the capture: compile, allocate, prepare each weight once
            call(s)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in sets:
            call(s)
    return graph


def time_graph(call: Callable[[dict], object], sets: list[dict], reps: int = 20) -> float:
    """Median µs per call of a CUDA graph that makes one call per set."""
    return statistics.median(replay_us(capture(call, sets), len(sets), reps))


def separator() -> Callable[[dict], None]:
    """A call-shaped one-element torch kernel: it launches without PDL, so the call after it cannot start early."""
    flag = torch.zeros(1, device="cuda")

    def bump(_s):
        flag.add_(1.0)
    return bump


def alternating_rounds(timers: dict, rounds: int) -> dict:
    """``{key: [µs per round]}`` for ``timers`` (``{key: () -> µs}``), each timed once per round, in reversed order
    every other round so that no timer always runs right after the same one; a timer that raises gets its exception
    in place of the list and is not timed again."""
    times = {key: [] for key in timers}
    for r in range(rounds):
        for key in list(timers) if r % 2 == 0 else reversed(list(timers)):
            if isinstance(times[key], Exception):
                continue
            try:
                times[key].append(timers[key]())
            except Exception as e:  # a timer that does not compile or launch: the caller reports it
                times[key] = e
    return times


def time_graph_separated(call: Callable[[dict], object], sets: list[dict], separator_us: float,
                         between: Callable[[dict], object] | None = None, reps: int = 20) -> float:
    """Median µs per call of a graph making one call per set, each followed by ``between`` (default
    ``separator()``), minus ``separator_us`` (``time_graph(between, sets)``, measured once per set list)."""
    between = between or separator()

    def call_then_between(s):
        call(s)
        between(s)
    return time_graph(call_then_between, sets, reps) - separator_us


PREDECESSOR_GEMM_K = 16384  # the inner size of ``gemm_predecessor``: at M <= 128 cuBLAS runs it split-K with PDL


class AfterTiming(NamedTuple):
    after_us: float  # from the end of the predecessor's last kernel to the end of the call's last kernel
    gap_us: float  # from that end to the start of the call's first kernel (negative: it launched early, PDL)
    first_kernel_us: float  # the call's first kernel's duration


def kernel_records(step: Callable[[dict], object], sets: list[dict], reps: int) -> list[list[dict]]:
    """The CUPTI kernel records of ``reps`` replays of a CUDA graph making ``step(s)`` for each set, grouped per
    step (each step must launch the same kernels every time)."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture(step, sets)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            kernels = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"),
                             key=lambda e: e["ts"])
    per_step, rest = divmod(len(kernels), reps * len(sets))
    groups = [kernels[i:i + per_step] for i in range(0, len(kernels), per_step)]
    if rest or not per_step or len({tuple(e["name"] for e in g) for g in groups}) != 1:
        raise RuntimeError(f"{len(kernels)} kernels in {reps} replays of {len(sets)} steps do not split into "
                           "identical groups")
    return groups


_PREDECESSOR_KERNELS = weakref.WeakKeyDictionary()  # predecessor -> kernels per step: profiled once, not per call


def time_after(call: Callable[[dict], object], sets: list[dict], predecessor: Callable[[dict], object],
               reps: int = 5) -> AfterTiming:
    """What a call adds after the kernel before it, as in a model: medians over the calls of a CUDA graph of
    ``predecessor`` then ``call`` per set, replayed under ``torch.profiler`` (kernel timestamps from CUPTI; a lower
    bound of a lone call's cost, steadier than a difference of graph times)."""
    n_pre = _PREDECESSOR_KERNELS.get(predecessor)
    if n_pre is None:
        n_pre = _PREDECESSOR_KERNELS[predecessor] = len(kernel_records(predecessor, sets[:1], 1)[0])

    def predecessor_then_call(s):
        predecessor(s)
        call(s)
    groups = kernel_records(predecessor_then_call, sets, reps)
    if len(groups[0]) <= n_pre:
        raise RuntimeError("time_after: the call launched no kernel")
    pre_end = [max(e["ts"] + e["dur"] for e in g[:n_pre]) for g in groups]
    return AfterTiming(
        statistics.median(max(e["ts"] + e["dur"] for e in g[n_pre:]) - end for g, end in zip(groups, pre_end)),
        statistics.median(g[n_pre]["ts"] - end for g, end in zip(groups, pre_end)),
        statistics.median(g[n_pre]["dur"] for g in groups))


def gemm_predecessor(sets: list[dict], k: int = PREDECESSOR_GEMM_K) -> Callable[[dict], None]:
    """The sublayer's output projection as the kernel before each call, as in a model: ``x_prev = a @ w``
    (cuBLAS, bf16; ``a`` [M, k] per set, ``w`` [k, H] shared), so the call reads what that kernel wrote. At small M
    cuBLAS's split-K reduce kernel triggers PDL, so a call with PDL launches before it ends."""
    m, hidden = sets[0]["x_prev"].shape
    device = sets[0]["x_prev"].device
    g = torch.Generator(device=device).manual_seed(1)
    w = (torch.randn(k, hidden, generator=g, device=device) / k ** 0.5).bfloat16()
    a = {id(s): torch.randn(m, k, generator=g, device=device).bfloat16() for s in sets}

    def gemm(s):
        torch.matmul(a[id(s)], w, out=s["x_prev"])
    return gemm


def context_predecessors(sets: list[dict]) -> dict[str, Callable[[dict], None]]:
    """The kernels a call follows in a model, by context name: one that does not trigger PDL (a one-element torch
    kernel, as most torch ops), and the sublayer's output projection writing ``x_prev`` (cuBLAS, which at small M
    triggers PDL, so the call's first kernel starts while it still runs)."""
    return dict(zip(CONTEXTS, (separator(), gemm_predecessor(sets))))


def launch_us(launch: Callable[[], object], reps: int = 20, batch: int = 1) -> list[float]:
    """µs per call of ``launch``, sorted: ``reps // batch`` timed batches of ``batch`` calls enqueued between two CUDA
    events (one untimed batch first). With ``batch`` 1 each call starts on an idle device, so its host launch is in
    its time; in a batch the host enqueues each call while the device runs the one before."""
    if reps < batch:
        raise ValueError(f"launch_us: reps ({reps}) below batch ({batch})")
    for _ in range(batch):
        launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps // batch):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            launch()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / batch)
    return sorted(times)


def replay_us(graph, calls_per_replay: int, reps: int = 20) -> list[float]:
    """µs per call of ``reps`` replays of ``graph`` (which makes ``calls_per_replay`` calls), timed in batches of
    ``REPLAY_BATCH`` replays so that no replay waits for its host launch, as the calls of a model's graph do not;
    sorted per batch."""
    return [t / calls_per_replay for t in launch_us(graph.replay, reps, REPLAY_BATCH)]


def time_eager(call: Callable[[dict], object], sets: list[dict], reps: int = 7) -> float:
    """Median wall µs per call of a loop of plain calls over the sets (host overhead included)."""
    for s in sets[:2]:
        call(s)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for s in sets:
            call(s)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / len(sets))
    return statistics.median(times)


HOST_MS = (1, 32, 256)  # the shapes of ``mhc-cute bench --host`` (at H = 7168)
HOST_MAX_M = 1024  # the full bench times auto's host time per call up to here
# Short loops: a call queues two or three launches; where its kernels outlast its host work (M = 256 on L2-hot inputs)
# a long loop queues them faster than the device retires them, and once the launch queue is full the host waits for
# the kernels and the loop times the device. 25 calls keep at most 75 launches queued.
HOST_CALLS, HOST_ROUNDS = 25, 80


def host_us_per_call(call: Callable[[dict], object], s: dict, calls: int = HOST_CALLS,
                     rounds: int = HOST_ROUNDS) -> float:
    """Host µs per call of a loop of plain calls on the same inputs under ``torch.inference_mode()`` (as a serving
    engine calls): the median over ``rounds`` loops of ``calls`` calls, each timed with ``time.perf_counter`` around
    the loop, nothing synchronised inside it. The device is synchronised between loops, outside the timing, so each
    loop starts with an empty launch queue, and ``calls`` is kept small enough that the queue cannot fill up (which
    would block the host on the kernels)."""
    with torch.inference_mode():
        call(s)
        torch.cuda.synchronize()
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                call(s)
            samples.append((time.perf_counter() - t0) * 1e6 / calls)
            torch.cuda.synchronize()
    return statistics.median(samples)


def host_floor_call(s: dict, backend: str = "auto", precision: str = "fp32") -> Callable[[dict], object]:
    """The bare minimum of host work of a call on ``s`` (the floor that ``host_us_per_call`` of an eager call is
    compared with): the outputs allocated with ``torch.empty`` (four; five for the delayed seam, ``s`` with
    ``pre_mix_prev``) and the call's compiled kernels launched through TVM-FFI with every other argument prepared
    once (weight, scratch, scalars). ``backend``'s choice (auto: the selector's) for this signature; a backend
    without compiled kernels (the reference, Triton) is its prepared launch instead. The call returns the outputs."""
    with torch.inference_mode():
        problem = problem_of(s, precision)
        m, h, dev = problem.m, problem.hidden, problem.residual.device
        launch = prepared_launch(problem, backend, None, problem.empty_outputs())
        bf16, f32 = torch.bfloat16, torch.float32
        gates = (m, 4) if problem.delayed else None  # the delayed seam's pre_mix_cur

        def outputs():
            out = (torch.empty(m, 4, h, dtype=bf16, device=dev), torch.empty(m, 4, 1, dtype=f32, device=dev),
                   torch.empty(m, 4, 4, dtype=f32, device=dev), torch.empty(m, h, dtype=bf16, device=dev))
            return out if gates is None else (*out, torch.empty(gates, dtype=f32, device=dev))

        if isinstance(launch, KernelLaunch):
            args = launch.arguments(problem.inputs, problem.empty_outputs())
            before, between, after = args[:OUTPUT_ARGS.start], args[OUTPUT_ARGS.stop:PRE_MIX_CUR_ARG], \
                args[PRE_MIX_CUR_ARG + 1:]
            compiled = launch.compiled

            def bare(_s):
                out = outputs()
                compiled(*before, *out[:4], *between, out[4] if gates else None, *after)
                return out
            return bare
        inputs = problem.inputs

        def prepared(_s):
            out = outputs()
            launch(inputs, out)
            return out
        return prepared


def compiled_call(precision: str = "fp32", delayed: bool = False) -> Callable[[dict], object]:
    """``mhc_fused_hc(backend="auto")`` (``delayed``: ``mhc_fused_hc_delayed``) inside a function compiled by
    ``torch.compile`` (inductor, static shapes, no CUDA graphs): the call goes through the custom op (``api``), whose
    per-call host cost ``host_us_per_call`` measures."""
    return torch.compile(mhc_cute_call("auto", precision, delayed=delayed), fullgraph=True, dynamic=False)


def tvm_ffi_tensor_path() -> str:
    """How TVM-FFI converts a torch tensor argument here: through torch's DLPack C exchange API (tens of ns per
    tensor; torch provides it, or TVM-FFI's optional extension adds it), or its Python fallback (``to_dlpack``,
    microseconds per tensor: a call passes 14 tensors)."""
    try:
        import tvm_ffi  # noqa: F401  (may install the exchange API on torch.Tensor)
    except Exception as e:  # not installed or broken: the CuTe paths are unavailable anyway
        return f"unavailable ({type(e).__name__})"
    fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    return "DLPack C exchange API (fast)" if fast else "Python to_dlpack fallback (slow)"


class HostTimes(NamedTuple):
    auto_us: float  # mhc_fused_hc(backend="auto"), host µs per eager call
    floor_us: float  # host_floor_call
    choice: str  # what auto runs: backend and tactic
    compiled_us: float | None = None  # compiled_call, when asked for


def host_times(m: int, hidden: int, device, norm: bool, precision: str = "fp32",
               compiled: bool = False, delayed: bool = False) -> HostTimes:
    """Host time per eager call of ``auto`` at (M, H) beside its floor (``host_floor_call``), and optionally through
    ``torch.compile`` (``compiled_call``); ``delayed``: of ``mhc_fused_hc_delayed`` with carried gates."""
    sets = make_sets(m, hidden, 1, device, norm)
    s = with_carried_gates(sets)[0] if delayed else sets[0]
    backend, tactic = SELECTOR.resolve(device, m, hidden, precision, norm, "delayed" if delayed else "v4")
    choice = f"{backend} {getattr(tactic, 'name', tactic) or '(default)'}"
    eager = mhc_cute_call("auto", precision, delayed=delayed)
    times = HostTimes(host_us_per_call(eager, s), host_us_per_call(host_floor_call(s, "auto", precision), s), choice)
    if compiled:
        times = times._replace(compiled_us=host_us_per_call(compiled_call(precision, delayed), s))
    return times


def op_host_times(op: str, m: int, hidden: int, device) -> HostTimes:
    """Host time per eager call of standalone ``op`` on ``auto`` at (M, H) (norm weight given where it takes one)
    beside its floor: the output allocated as the op does and its backend's entry called on the flat inputs with the
    scalars prepared once (the plan ``ops`` keeps for the signature, minus its per-call checks)."""
    inputs = make_op_inputs(op, m, hidden, device=device, norm=op != "mhc_post")
    with torch.inference_mode():
        call_op(op, inputs)
    plan = ops.last_plan(op)
    flat = plan.flatten(tuple(inputs.values()))  # the op's tensor arguments, in its order

    def bare(_s):
        out = plan.alloc(flat)
        plan.run(*flat, *plan.scalars, out)
        return out
    return HostTimes(host_us_per_call(lambda s: call_op(op, s), inputs), host_us_per_call(bare, inputs),
                     ops.auto_backend(op, inputs["residual"].device, hidden))


def format_host_table(rows: list[tuple[int, int, HostTimes]], gpu: str, op: str = "mhc_fused_hc") -> str:
    """``rows``: (H, M, ``host_times`` or ``op_host_times``) per shape of ``op``."""
    compiled = any(t.compiled_us is not None for *_, t in rows)
    seams = {"mhc_fused_hc": 4, "mhc_fused_hc_delayed": 5}
    floor = (f"{seams[op]} torch.empty + the compiled kernels' TVM-FFI call with prepared arguments" if op in seams
             else "the output's allocation + the backend's entry on the flat inputs")
    lines = [f"GPU: {gpu}; host µs per call of {op}(backend=\"auto\"): median of {HOST_ROUNDS} loops of "
             f"{HOST_CALLS} eager calls under torch.inference_mode(); floor = {floor}"
             + ("; compiled = through torch.compile (inductor, no CUDA graphs)" if compiled else ""),
             f"TVM-FFI {dist_version('apache-tvm-ffi')}, torch tensors via {tvm_ffi_tensor_path()}"]
    head = f"{'H':>5} {'M':>6} | {'auto eager':>10} {'floor':>7} {'ratio':>6}" + (f" {'compiled':>9}" * compiled)
    lines += [head + " | auto runs", "-" * (len(head) + 40)]
    for h, m, t in rows:
        cells = f"{t.auto_us:10.1f} {t.floor_us:7.1f} {t.auto_us / t.floor_us:6.2f}"
        if compiled:
            cells += f" {t.compiled_us:9.1f}" if t.compiled_us is not None else f" {'-':>9}"
        lines.append(f"{h:>5} {m:>6} | {cells} | {t.choice}")
    return "\n".join(lines)


# --- what gets timed ------------------------------------------------------------------------------------------

def mhc_cute_call(backend: str, precision: str = "fp32", tactic=None,
                  delayed: bool = False) -> Callable[[dict], object]:
    """A set's call of ``mhc_fused_hc`` (``delayed``: ``mhc_fused_hc_delayed``, on sets with ``pre_mix_prev``)."""
    op = mhc_fused_hc_delayed if delayed else mhc_fused_hc

    def call(s):
        return op(**s, backend=backend, precision=precision, tactic=tactic)
    return call


def v4_auto(s: dict, precision: str = "fp32") -> MhcFusedHcOutput:
    """``mhc_fused_hc``'s ``auto`` on a set (its ``pre_mix_prev``, if any, left out): the comparison column of the
    delayed seam's and the standalone ops' benches."""
    return mhc_fused_hc(s["x_prev"], s["residual_prev"], s["post_mix_prev"], s["comb_mix_prev"], s["fn"],
                        s["hc_scale"], s["hc_base"], norm_weight=s["norm_weight"], precision=precision)


def beside_the_v4_seam(call_of: Callable[[str], Callable[[dict], object]], backends: list[str],
                       v4: Callable[[dict], object]) -> dict[str, Callable[[dict], object]]:
    """The calls of a bench that times another op or form: ``call_of(name)`` for ``auto`` and ``backends``, then
    ``v4`` (``mhc_fused_hc``'s ``auto`` on the same tokens) as the comparison column."""
    return {"auto": call_of("auto"), **{n: call_of(n) for n in backends}, "mhc_fused_hc auto": v4}


def delayed_calls(backends: list[str], precision: str = "fp32") -> dict[str, Callable[[dict], object]]:
    """``mhc-cute bench --delayed``: the delayed seam's ``auto`` and ``backends`` on sets with ``pre_mix_prev``
    (``with_carried_gates``), and ``mhc_fused_hc``'s ``auto`` on the same sets as the comparison column."""
    return beside_the_v4_seam(lambda b: mhc_cute_call(b, precision, delayed=True), backends,
                              lambda s: v4_auto(s, precision))


def form_sets(form: str, sets: list[dict]) -> list[dict]:
    """``sets`` as a seam's inputs in entry ``form`` under ``"form"`` (``"no_post"``: no ``x_prev``, ``post_mix_prev``,
    ``comb_mix_prev``; ``"broadcast"``: also ``residual_prev`` the embedding ``[M, H]``, stream 0's values, and the
    delayed seam's identity gates, as V4.1's entry), each beside the regular seam's under ``"seam"`` (the comparison
    column)."""
    out = []
    for s in sets:
        f = dict(s, x_prev=None, post_mix_prev=None, comb_mix_prev=None)
        if form == "broadcast":
            f["residual_prev"] = s["residual_prev"][:, 0].contiguous()
            if "pre_mix_prev" in f:
                f["pre_mix_prev"] = None
        out.append(dict(form=f, seam=s))
    return out


def form_calls(backends: list[str], delayed: bool, precision: str = "fp32") -> dict[str, Callable[[dict], object]]:
    """``mhc-cute bench --form``: the seam (``delayed``: ``mhc_fused_hc_delayed``) in an entry form, ``auto`` and
    ``backends`` on ``form_sets``, and ``mhc_fused_hc``'s ``auto`` on the regular seam's inputs as the comparison
    column (the SPEC's target: an entry form no slower than a seam)."""
    fn = mhc_fused_hc_delayed if delayed else mhc_fused_hc

    def of(backend):
        def call(s):
            return fn(**s["form"], backend=backend, precision=precision)
        return call

    return beside_the_v4_seam(of, backends, lambda s: v4_auto(s["seam"], precision))


def op_sets(op: str, sets: list[dict]) -> list[dict]:
    """``sets`` (with carried gates) as a standalone op's inputs (``accuracy.op_inputs_of``) under ``"op"``, each
    beside its seam inputs under ``"seam"`` (the comparison column)."""
    return [dict(op=op_inputs_of(op, s), seam=s) for s in sets]


def op_calls(op: str, backends: list[str]) -> dict[str, Callable[[dict], object]]:
    """``mhc-cute bench --op``: the standalone op's ``auto`` and ``backends`` on ``op_sets``, and ``mhc_fused_hc``'s
    ``auto`` on the same tokens as the comparison column (a seam moves about as many bytes as ``mhc_post`` or
    ``mhc_head``)."""
    fn = getattr(ops, op)

    def of(backend):
        def call(s):
            return fn(**s["op"], backend=backend)
        return call

    return beside_the_v4_seam(of, backends, lambda s: v4_auto(s["seam"]))


def with_carried_gates(sets: list[dict], seed: int = 1) -> list[dict]:
    """``sets`` with the delayed seam's ``pre_mix_prev`` (gates as a previous seam returns them) added."""
    g = torch.Generator(device=sets[0]["fn"].device).manual_seed(seed)
    for s in sets:
        m = s["residual_prev"].shape[0]
        s["pre_mix_prev"] = torch.sigmoid(torch.randn(m, 4, generator=g, device=s["fn"].device)) + 1e-6
    return sets


def torch_fp32_boundary(x, res, post, comb, fn, scale, base, norm_weight=None, eps=1e-6, post_mult=2.0, repeat=20):
    """The boundary op as a user would write it in plain fp32 torch (the "torch" peers)."""
    rc = (post * x.float()[:, None, :] + torch.einsum("mkj,mkh->mjh", comb, res.float())).bfloat16()
    xf = rc.float().flatten(1)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    col_scale = torch.cat([scale[0:1].expand(4), scale[1:2].expand(4), scale[2:3].expand(16)])
    mixes = (xf @ fn.t()) * rstd * col_scale + base
    pre = torch.sigmoid(mixes[:, :4]) + eps
    post_cur = torch.sigmoid(mixes[:, 4:8]) * post_mult
    c = torch.softmax(mixes[:, 8:].view(-1, 4, 4), -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    li = (pre[:, :, None] * rc.float()).sum(1).bfloat16()
    if norm_weight is not None:
        lf = li.float()
        li = (lf * torch.rsqrt(lf.square().mean(-1, keepdim=True) + eps) * norm_weight.float()).bfloat16()
    return rc, post_cur[:, :, None], c, li


def _torch_args(s):
    return (s["x_prev"], s["residual_prev"], s["post_mix_prev"], s["comb_mix_prev"], s["fn"], s["hc_scale"],
            s["hc_base"], s["norm_weight"])


def peer_calls(norm: bool) -> dict[str, Callable[[dict], object]]:
    """Peers importable here: torch eager, torch.compile, and DeepSeek's TileKernels (tile-kernels 1.0.0)."""
    peers = {"torch-eager": lambda s: torch_fp32_boundary(*_torch_args(s))}
    compiled = torch.compile(torch_fp32_boundary, dynamic=True)
    peers["torch-compile"] = lambda s: compiled(*_torch_args(s))
    try:
        from tile_kernels.modeling.mhc.ops.post import mhc_post
        from tile_kernels.modeling.mhc.ops.pre_big_fuse import mhc_pre_big_fuse
    except Exception:  # not installed (or its TileLang cannot load): the table says the peer is missing
        return peers
    if norm:  # TileKernels has no fused RMSNorm; it would need an extra launch, so it is compared without norm
        return peers

    def tilekernels(s):
        m, h = s["x_prev"].shape
        rc = mhc_post(s["x_prev"][None], s["residual_prev"][None], s["post_mix_prev"][None],
                      s["comb_mix_prev"][None])
        return mhc_pre_big_fuse(rc[0], s["fn"], s["hc_scale"], s["hc_base"], 1e-6, 1e-6, 1e-6, 2.0, 20)
    peers["tilekernels"] = tilekernels
    return peers


def bench_one(name, call, m, hidden, device, norm, bandwidth, sets=None, eager=True, contexts=None,
              floor=floor_bytes) -> Result:
    """One (backend or peer, M, H) cell; with ``contexts`` ({name: predecessor}, ``context_predecessors``) also what
    the call adds after each predecessor (``time_after``); ``floor``: the bytes of the floor column."""
    r = Result(name, m, hidden)
    try:
        sets = sets or rotated_sets(m, hidden, device, norm)
        r.graph_us = time_graph(call, sets)
        for context, predecessor in (contexts or {}).items():
            r.context_us[context] = time_after(call, sets, predecessor).after_us
        if eager:
            r.eager_us = time_eager(call, sets)
        r.floor_frac = floor(m, hidden) / bandwidth * 1e6 / r.graph_us
    except Exception as e:  # a failing backend or peer is reported in the table, not fatal to the run
        r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return r


def format_table(results: list[Result], bandwidth: float, gpu: str) -> str:
    lines = [f"GPU: {gpu}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); "
             "graph = CUDA-graph replay µs/call (back to back); after-kernel, after-gemm = µs a call adds after a "
             "one-element non-PDL kernel / a cuBLAS GEMM (CUPTI); eager = wall µs/call; "
             "floor = SPEC floor / graph time"]
    names = list(dict.fromkeys(r.name for r in results))
    head = f"{'H':>5} {'M':>6} | " + " | ".join(f"{n[:38]:>38}" for n in names)
    lines += [head, "-" * len(head)]
    by = {(r.hidden, r.m, r.name): r for r in results}
    for h, m in dict.fromkeys((r.hidden, r.m) for r in results):
        cells = []
        for n in names:
            r = by.get((h, m, n))
            if r is None or r.graph_us is None:
                cells.append(f"{'-' if r is None else 'error':>38}")
            else:
                after = " ".join(f"{r.context_us[c]:7.2f}" if c in r.context_us else "      -" for c in CONTEXTS)
                eager = f"{r.eager_us:7.1f}" if r.eager_us is not None else "    n/a"
                cells.append(f"{r.graph_us:7.2f} {after} {eager} {100 * r.floor_frac:4.0f}%")
        lines.append(f"{h:>5} {m:>6} | " + " | ".join(cells))
    lines.append(f"cells: graph µs, {' µs, '.join(CONTEXTS)} µs, eager µs, % of floor")
    host = [(r.hidden, r.m, HostTimes(**r.host)) for r in results if r.host]
    if host:
        lines += ["", format_host_table(host, gpu)]
    errors = [r for r in results if r.error]
    for r in errors:
        lines.append(f"error H={r.hidden} M={r.m} {r.name}: {r.error}")
    return "\n".join(lines)


def fastest(graph_us: dict, hidden: int, m: int, names) -> str | None:
    """The name among ``names`` with the least time at (H, M) in ``graph_us`` {(H, M, name): µs}, if any ran."""
    times = {n: graph_us[(hidden, m, n)] for n in names if graph_us.get((hidden, m, n)) is not None}
    return min(times, key=times.get, default=None)


def auto_summary(results: list[Result], backends: list[str]) -> str:
    """Per shape: ``auto``'s time over that of the fastest of ``backends`` in the same run (1.00: it ran as fast as
    the best of them; below 1: faster than each, as when only Triton is timed beside it)."""
    by = {(r.hidden, r.m, r.name): r.graph_us for r in results if r.graph_us is not None}
    lines = [f"auto / the fastest of {', '.join(backends)} (graph replay; below 1: auto is faster than each):"]
    for h, m in dict.fromkeys((r.hidden, r.m) for r in results):
        best = fastest(by, h, m, backends)
        if (h, m, "auto") in by and best is not None:
            lines.append(f"  H={h} M={m}: {by[(h, m, 'auto')] / by[(h, m, best)]:.3f} (fastest: {best})")
    return "\n".join(lines)


def plot(results: list[Result], path: str, gpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hs = sorted({r.hidden for r in results})
    fig, axes = plt.subplots(1, len(hs), figsize=(7 * len(hs), 5), squeeze=False)
    for ax, h in zip(axes[0], hs):
        for name in dict.fromkeys(r.name for r in results):
            pts = sorted((r.m, r.graph_us) for r in results if r.hidden == h and r.name == name and r.graph_us)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("µs per call (CUDA-graph replay)")
        ax.set_title(f"mhc_fused_hc, H = {h}, {gpu}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json(results: list[Result], path: str, bandwidth: float | None, gpu: str, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump(dict(gpu=gpu, copy_bandwidth=bandwidth, meta=meta, results=[asdict(r) for r in results]), f,
                  indent=1)


# --- one forward pass of a model (``mhc-cute bench --model``) ---------------------------------------------------

class ModelConfig(NamedTuple):
    """The mHC shape of a DeepSeek model: H, layers (2 sublayers each), Engram layers, V4.1's delayed seams.
    From the models' released configs: H (``docs/contract.md``), layers (V4-Pro 61, V4-Flash 43, V4.1-Flash 40) and
    V4.1-Flash's Engram layers {1, 14}."""
    hidden: int
    layers: int
    engram_layers: tuple = ()
    delayed: bool = False


MODELS = {
    "v4-pro": ModelConfig(7168, 61),
    "v4-flash": ModelConfig(4096, 43),
    "v4.1-flash": ModelConfig(5120, 40, (1, 14), delayed=True),
}
MODEL_OUTPUT_BYTES = 16 << 30  # at most this much of distinct precomputed sublayer outputs (reused cyclically)


# SPEC's cost model of each op of a forward pass (``model_ops`` names); the delayed entry and the no-post seams move
# the same H-sized rows as their V4 forms (their gate bytes are a few dozen per token)
FORM_FLOORS = {"no_post": no_post_floor_bytes, "broadcast": entry_floor_bytes}
OP_FLOORS = {
    "seam": floor_bytes, "delayed_seam": delayed_floor_bytes, "entry": entry_floor_bytes,
    "delayed_entry": entry_floor_bytes, "no_post_delayed_seam": no_post_floor_bytes, "post": post_floor_bytes,
    "collapse": collapse_floor_bytes, "head": head_floor_bytes,
}


def op_floor_bytes(op: str, m: int, h: int) -> int:
    """SPEC's floor of one call of ``op`` on ``m`` tokens (bytes read + written; weights once per call)."""
    return OP_FLOORS[op](m, h)


def model_ops(config: ModelConfig) -> list[str]:
    """The mHC ops of one forward pass of ``config`` (``op_floor_bytes`` names), in order."""
    n = 2 * config.layers
    if not config.delayed:
        return ["entry"] + ["seam"] * (n - 1) + ["post", "head"]
    engram_seams = sum(1 for layer in config.engram_layers if 0 < layer < config.layers)
    return (["delayed_entry"] + ["delayed_seam"] * (n - 1 - engram_seams)
            + ["post", "no_post_delayed_seam"] * engram_seams + ["post", "collapse"])


def model_floor_bytes(config: ModelConfig, m: int) -> int:
    return sum(op_floor_bytes(op, m, config.hidden) for op in model_ops(config))


def model_inputs(config: ModelConfig, m: int, device, seed: int = 0) -> dict:
    """Random inputs of one forward: the embedding, per-sublayer weights (each seam its own), precomputed sublayer
    outputs (distinct up to ``MODEL_OUTPUT_BYTES``, then reused cyclically), the head weights and the final norm."""
    h, n = config.hidden, 2 * config.layers
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=g, device=device)

    n_outputs = max(2, min(n, MODEL_OUTPUT_BYTES // (2 * m * h)))
    outputs = [randn(m, h).bfloat16() for _ in range(n_outputs)]
    return dict(
        embedding=randn(m, h).bfloat16(),
        weights=[SublayerWeights(randn(24, 4 * h) / math.sqrt(4 * h), torch.rand(3, generator=g, device=device) + 0.5,
                                 randn(24) * 0.5, (1 + 0.1 * randn(h)).bfloat16()) for _ in range(n)],
        sublayers=[lambda _x, y=outputs[i % n_outputs]: y for i in range(n)],
        head=HeadWeights(randn(4, 4 * h) / math.sqrt(4 * h), torch.rand(1, generator=g, device=device) + 0.5,
                         randn(4) * 0.5, (1 + 0.1 * randn(h)).bfloat16()),
        engram={layer: (lambda r: r) for layer in config.engram_layers},  # the Engram module is not mHC: identity
    )


def model_forward_calls(config: ModelConfig) -> dict[str, Callable[[dict], object]]:
    """The forwards timed for ``config``: mhc_cute's ``auto`` and ``torch`` (the reference, fp32) through
    ``mhc_cute.model``, and for V4 the same forward on DeepSeek's TileKernels (when importable): its ``mhc_post``,
    ``mhc_pre_big_fuse`` (no fused RMSNorm: it runs without the sublayer norms, favouring it) and ``mhc_head``."""
    def ours(backend):
        if config.delayed:
            return lambda s: mhc_forward_v41(s["embedding"], s["weights"], s["sublayers"], s["head"].norm_weight,
                                             engram=s["engram"], backend=backend)
        return lambda s: mhc_forward_v4(s["embedding"], s["weights"], s["sublayers"], s["head"], backend=backend)

    calls = {"auto": ours("auto"), "torch": ours("torch")}
    if not config.delayed:
        tile_kernels = tilekernels_forward_v4()
        if tile_kernels is not None:
            calls["tilekernels"] = tile_kernels
    return calls


def tilekernels_forward_v4():
    """The V4 forward on TileKernels 1.0.0's ops (None when not importable): the entry's 4 copies written by torch,
    then ``mhc_pre_big_fuse``; per seam ``mhc_post`` + ``mhc_pre_big_fuse``; the end ``mhc_post`` + ``mhc_head``."""
    try:
        import torch.nn.functional as F
        from tile_kernels.modeling.mhc.ops.head_compute_mix import mhc_head_compute_mix
        from tile_kernels.modeling.mhc.ops.norm_fn import mhc_pre_norm_fn
        from tile_kernels.modeling.mhc.ops.post import mhc_post
        from tile_kernels.modeling.mhc.ops.pre_apply_mix import mhc_pre_apply_mix
        from tile_kernels.modeling.mhc.ops.pre_big_fuse import mhc_pre_big_fuse
    except Exception:  # not installed (or its TileLang cannot load): the table says the peer is missing
        return None

    def head(residual, h):
        # TileKernels 1.0.0's own ``mhc_head`` hands its mix kernel a strided slice of the mixes, which that kernel
        # refuses past one token: the same three ops, the slice made contiguous
        mixes = mhc_pre_norm_fn(residual, F.pad(h.fn, (0, 0, 0, 20)), None, 1e-6, n_splits=16)
        mix = mhc_head_compute_mix(mixes[..., :4].contiguous(), h.scale.reshape(1), h.base, 1e-6)
        return mhc_pre_apply_mix(residual, mix.unsqueeze(-1))

    def forward(s):
        e = s["embedding"]
        residual = e[:, None, :].expand(e.shape[0], 4, e.shape[1]).contiguous()
        post = comb = y = None
        for i, (w, sublayer) in enumerate(zip(s["weights"], s["sublayers"])):
            if i:
                residual = mhc_post(y[None], residual[None], post[None], comb[None])[0]
            post, comb, li = mhc_pre_big_fuse(residual, w.fn, w.hc_scale, w.hc_base, 1e-6, 1e-6, 1e-6, 2.0, 20)
            y = sublayer(li)
        residual = mhc_post(y[None], residual[None], post[None], comb[None])[0]
        return head(residual[None], s["head"])[0]
    return forward


class ModelResult(NamedTuple):
    model: str
    name: str
    m: int
    ms: float | None  # per forward (CUDA-graph replay)
    floor_frac: float | None
    error: str | None = None


TORCH_MODEL_MAX_M = 256  # the fp32 reference's forward takes seconds past this (V4-Pro, M = 2048: 2.5 s on an H200)


def bench_model(model: str, ms, device, bandwidth: float, names=None, log=None) -> list[ModelResult]:
    """Time one forward of ``model``'s mHC ops per M (one CUDA graph per M and forward, replayed); the torch
    reference only up to ``TORCH_MODEL_MAX_M`` unless named in ``names``."""
    config = MODELS[model]
    calls = model_forward_calls(config)
    results = []
    for m in ms:
        inputs = model_inputs(config, m, device)
        floor_s = model_floor_bytes(config, m) / bandwidth
        for name, call in calls.items():
            if (name not in names) if names else (name == "torch" and m > TORCH_MODEL_MAX_M):
                continue
            try:
                t_us = time_graph(call, [inputs], reps=12)  # three batches of replays
                results.append(ModelResult(model, name, m, t_us / 1e3, floor_s * 1e6 / t_us))
            except Exception as e:  # a failing forward is reported in the table, not fatal to the run
                results.append(ModelResult(model, name, m, None, None,
                                           f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"))
            if log:
                log(results[-1])
            torch.cuda.empty_cache()
        del inputs
        torch.cuda.empty_cache()
    return results


def format_model_table(results: list[ModelResult], bandwidth: float, gpu: str) -> str:
    """Per M: the floor (ms), then per forward ms / forward, µs / token and % of the floor."""
    model = results[0].model if results else "?"
    config = MODELS.get(model)
    names = list(dict.fromkeys(r.name for r in results))
    lines = [f"mHC ops of one {model} forward ({config.layers if config else '?'} layers, H = "
             f"{config.hidden if config else '?'}) on {gpu}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
             "CUDA-graph replay; cells: ms / forward, µs / token, % of the floor"]
    lines.append(f"{'M':>6} {'floor ms':>9} " + " ".join(f"{n:>26}" for n in names))
    for m in sorted({r.m for r in results}):
        floor_ms = model_floor_bytes(config, m) / bandwidth * 1e3 if config else float("nan")
        cells = []
        for n in names:
            r = next((r for r in results if r.m == m and r.name == n), None)
            if r is None or r.ms is None:
                cells.append(f"{'failed' if r else '-':>26}")
            else:
                cells.append(f"{r.ms:9.3f} {1e3 * r.ms / m:9.3f} {100 * r.floor_frac:5.0f}%")
        lines.append(f"{m:>6} {floor_ms:9.3f} " + " ".join(cells))
    errors = {(r.name, r.error) for r in results if r.error}
    lines += [f"  {n}: {e}" for n, e in sorted(errors)]
    return "\n".join(lines)
