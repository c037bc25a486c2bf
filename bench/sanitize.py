"""Every kernel backend of every kernel-backed op under ``compute-sanitizer`` (memcheck, racecheck, synccheck,
initcheck), over a grid that reaches every kernel shape; a table (case x tool: errors), exit status 1 on any
finding.

    python bench/sanitize.py --shard 1/4 --json $OUT/sanitize-1.json
    python bench/sanitize.py --list                      # the cases (no GPU needed)
    python bench/sanitize.py --merge a.json b.json ...   # one table from the shards' results (no GPU needed)
    MHC_CUTE_KERNEL_CACHE=/tmp/kc python bench/sanitize.py --precompile-only   # compile ahead (no GPU needed)

The grid (``OPS``, one entry per op): for ``mhc_fused_hc``, every kernel backend at M in {1, 3, 17, 130, 1031}
x H in {512, 4096, 5120, 7168} with its default tactic (the norm on where the indices of M and H have the same
parity, so each M and each H runs with and without it), plus the extreme explicit tactics: the most K splits, the
FMA paths' projection on warp MMA (each tile shape), a pipelined FFMA tactic, ``one_per_sm`` flipped, each shape
of the standalone big fuse (``lat``, ``bw``, ``latp``, ``bwp``, at every H), the tensor-core paths with one
K split, the other M tile and TF32, Triton chunked, one call per backend captured in a CUDA graph and replayed
on new inputs, and one with a NaN in one token (checked against the non-finite policy). Ops that this checkout may not have yet (``mhc_fused_hc_delayed``, ``mhc_post``,
``mhc_collapse``, ``mhc_head``) have entries that run once ``mhc_cute`` exports them; a new op is one more entry.

How it runs: (1) the CuTe kernels of the selected cases are compiled in parallel processes into
``$MHC_CUTE_KERNEL_CACHE`` (default /tmp/mhc-kcache), so that no sanitized process compiles; (2) one process
runs every case without a sanitizer, checking the outputs against the float64 contract (Triton compiles into its
cache here; the ``check`` column); (3) per tool, processes ``compute-sanitizer --tool T ... python
bench/sanitize.py --worker --cases ...`` run chunks of cases once each. A worker prints a marker before and after
each case, so the sanitizer's reports are attributed to the case that was running; a process that dies (a kernel
fault leaves the CUDA context unusable) or hangs past ``--timeout`` marks its case and the parent starts a new one
for the rest. Memcheck and initcheck run with torch's caching allocator off (every tensor its own allocation, so
an access past a tensor's end is out of bounds and unwritten bytes are uninitialised), except the graph cases,
whose capture needs the allocator's private pool. ``--budget`` stops launching processes in time to print the
table within a time-limited run; the pairs not run are listed and the exit status is 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:  # bench/precompile.py, however this script was loaded
    sys.path.insert(0, str(ROOT / "bench"))
import precompile as precompile_script  # noqa: E402
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
MS = (1, 3, 17, 130, 1031)
HS = (512, 4096, 5120, 7168)
SM_COUNT = 132  # the SM count the explicit tactics are derived for (H100/H200 SXM); valid on any GPU
DEFAULT_KERNEL_CACHE = "/tmp/mhc-kcache"  # bench/gpu_run.sh's
ERROR_EXITCODE = 99
BEGIN, END = "@@sanitize-begin", "@@sanitize-end"
FATAL_EXIT = 3  # a worker whose CUDA context is no longer usable


# --- the cases ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One call: ``op`` on ``backend`` at M x H, the norm on or off, a tactic (a CuTe tactic name; for Triton
    ``field=value`` overrides of its default joined by ``+``; None: the backend's default for M), precision, and
    whether the call is captured in a CUDA graph and replayed."""

    op: str
    backend: str
    m: int
    h: int
    norm: bool
    label: str = "default"
    tactic: str | None = None
    precision: str = "fp32"
    graph: bool = False

    @property
    def name(self) -> str:
        return (f"{self.op}/{self.backend}/M{self.m}/H{self.h}/{'norm' if self.norm else 'nonorm'}/"
                f"{self.precision}/{self.label}")

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode()) % (1 << 31)


class OpSpec(NamedTuple):
    """An op of the sweep (``OPS``, keyed by its ``mhc_cute`` name): its grid, its inputs (keyword arguments on a
    device), the call, the contract check of the unsanitized pass (None: the call only has to run), and the inputs a
    CUDA graph case copies new values into before each replay."""

    cases: Callable[[], list]
    inputs: Callable[[Case, str], dict]
    call: Callable[[Case, dict], object]
    check: Callable[[Case, dict, object], None] | None = None
    activations: tuple = ()


def kernel_backends() -> list[str]:
    from mhc_cute import BACKENDS

    return [name for name, b in BACKENDS.items() if b.kind != "reference"]


def checkerboard(op: str, backend: str, norm_applies: bool = True) -> list[Case]:
    """Every M x H of the grid with the backend's default tactic; the norm on where the indices of M and H have the
    same parity."""
    return [Case(op, backend, m, h, norm_applies and (i + j) % 2 == 0)
            for i, m in enumerate(MS) for j, h in enumerate(HS)]


# points of the standalone big-fuse shapes: every H, one and several K splits, both norm flags
FUSE_POINTS = ((3, 4096, True), (130, 7168, True), (17, 5120, False), (1, 512, True))


def _fma_cases(path: str) -> list[Case]:
    from mhc_cute import autotune, tactics as tac

    sys.path.insert(0, str(ROOT / "tests"))
    from test_correctness import warp_mma_tactics

    out = []

    def add(label, m, h, norm, tactic):
        if tactic.invalid_reason(h) is None:
            out.append(Case("mhc_fused_hc", path, m, h, norm, label, tactic.name))

    ffma = tac.ffma_tactic(path, 130, 7168, SM_COUNT)
    add("max-split", 130, 7168, True, replace(ffma, split_k=tac.largest_split(7168, ffma.chunk_h, 7168)))
    add("pipelined", 130, 4096, False, replace(tac.ffma_tactic(path, 130, 4096, SM_COUNT), stages=2, burst=4))
    # the projection on warp MMA: every tile the tuner tries (tokens x threads x tile_n, at the default big-fuse
    # shape) and the tests' pipelined and 3-token ones
    default_fuse = tac.default_fuse(path, 17)
    mma = [t for t in autotune.candidate_tactics(path, 17, 5120, SM_COUNT)
           if t.warp_mma and t.fuse == default_fuse and not t.one_per_sm] + warp_mma_tactics(path, 5120)
    for t in dict.fromkeys(replace(t, fuse=default_fuse) for t in mma):
        add(f"warp_mma-t{t.tokens_per_cta}-w{t.threads}-n{t.tile_n}-s{t.stages}b{t.burst}", 17, 5120, True, t)
    if path == "half_fma":
        for m, h, norm in ((17, 7168, True), (1031, 4096, False)):
            d = tac.default_fma_tactic(path, m, h, SM_COUNT)
            add("one_per_sm-flipped", m, h, norm, replace(d, one_per_sm=not d.one_per_sm))
        for m, h, norm in FUSE_POINTS:
            for shape in tac.FUSE_SHAPES:
                add(f"fuse-{shape}", m, h, norm, replace(tac.default_fma_tactic(path, m, h, SM_COUNT), fuse=shape))
    return out


def _mma_cases(path: str) -> list[Case]:
    from mhc_cute import tactics as tac

    out = []

    def add(label, m, h, norm, tactic, precision="fp32"):
        if tactic.invalid_reason(h) is None:
            out.append(Case("mhc_fused_hc", path, m, h, norm, label, tactic.name, precision))

    add("max-split", 130, 7168, True,
        replace(tac.default_mma_tactic(path, 130, 7168, SM_COUNT), split_k=7168 // tac.MMA_BLOCK_H))
    add("split-1", 130, 4096, False, replace(tac.default_mma_tactic(path, 130, 4096, SM_COUNT), split_k=1))
    for m, h in ((17, 4096), (130, 5120)):  # the other M tile (64 <-> 128), with the deepest pipeline that fits
        d = tac.default_mma_tactic(path, m, h, SM_COUNT)
        other = [replace(d, tile_m=192 - d.tile_m, stages=s) for s in range(8, 1, -1)]
        add(f"tile-{192 - d.tile_m}", m, h, True, next((t for t in other if t.invalid_reason(h) is None), other[-1]))
    for m, h in ((17, 7168), (1031, 4096)):
        add("tf32", m, h, True, tac.default_mma_tactic(path, m, h, SM_COUNT), "tf32")
    if path == "half_mma":
        for m, h, norm in FUSE_POINTS:
            for shape in tac.FUSE_SHAPES:
                add(f"fuse-{shape}", m, h, norm, replace(tac.default_mma_tactic(path, m, h, SM_COUNT), fuse=shape))
    return out


def fused_hc_cases() -> list[Case]:
    from mhc_cute import tactics as tac

    out = []
    for b in kernel_backends():
        out += checkerboard("mhc_fused_hc", b)
        if b in tac.FMA_PATHS:
            out += _fma_cases(b)
        elif b in tac.MMA_PATHS:
            out += _mma_cases(b)
        elif b == "triton":
            out += [Case("mhc_fused_hc", b, 130, 7168, True, "max-split", "split_k=1048576"),
                    Case("mhc_fused_hc", b, 1031, 4096, True, "chunked", "chunk_m=256")]
        if b in tac.FMA_PATHS + tac.MMA_PATHS:
            # the seam without post (residual_prev read as the streams) and the broadcast entry (the embedding read
            # once, stored 4 times): one and several tokens per CTA or tile
            out += [Case("mhc_fused_hc", b, m, h, norm, "no_post")
                    for m, h, norm in ((1, 7168, True), (130, 512, False), (1031, 4096, True))]
            out += [Case("mhc_fused_hc", b, m, h, norm, "broadcast")
                    for m, h, norm in ((3, 5120, True), (130, 512, False), (1031, 7168, True))]
        out.append(Case("mhc_fused_hc", b, 17, 4096, True, "graph", graph=True))
        out.append(Case("mhc_fused_hc", b, 17, 4096, True, "nonfinite"))
    return out


def triton_tactic(case: Case):
    """The Triton tactic of a case: its default for M with the case's overrides."""
    import torch

    from mhc_cute.triton import fused_hc

    t = fused_hc._default_tactic(torch.device("cuda"), case.m, case.h)
    return replace(t, **{k: int(v) for k, v in (kv.split("=") for kv in case.tactic.split("+"))})


NONFINITE_TOKEN = 5  # the "nonfinite" cases: NaN in one value of x_prev of this token
ENTRY_FORMS = ("no_post", "broadcast")  # the cases labelled with an entry form run the seam in that form


def case_form(case: Case) -> str:
    return case.label if case.label in ENTRY_FORMS else "regular"


def fused_hc_inputs(case: Case, device: str, clean: bool = False) -> dict:
    from mhc_cute.accuracy import gpu_nan, make_inputs

    inputs = make_inputs(case.m, case.h, seed=case.seed, device=device, norm=case.norm,
                         form=case_form(case))
    if case.label == "nonfinite" and not clean:
        x = inputs["x_prev"]
        x[NONFINITE_TOKEN, case.h // 3] = gpu_nan(x.dtype).to(device)
    return inputs


def fused_hc_call(case: Case, inputs: dict):
    import mhc_cute

    tactic = case.tactic
    if tactic is not None and case.backend == "triton":
        tactic = triton_tactic(case)
    return mhc_cute.mhc_fused_hc(**inputs, backend=case.backend, precision=case.precision, tactic=tactic)


def fused_hc_check(case: Case, inputs: dict, out) -> None:
    """The float64 contract; for the "nonfinite" cases the non-finite policy against the same call without the NaN."""
    from mhc_cute.accuracy import check_outputs, check_poisoned_token, problem_of, tolerances

    problem = problem_of(inputs, case.precision)
    if case.label == "no_post":  # the op returns residual_prev itself; the contract reads the kernels' outputs
        assert out.residual_cur is inputs["residual_prev"], "residual_cur: not residual_prev itself"
        out = out._replace(residual_cur=None)
    if case.label == "nonfinite":
        clean = fused_hc_call(case, fused_hc_inputs(case, str(inputs["x_prev"].device), clean=True))
        check_poisoned_token(out, clean, problem, NONFINITE_TOKEN)
    else:
        check_outputs(out, problem, **tolerances(case.backend, case.precision))


# Ops this checkout may not have yet: their cases run once ``mhc_cute`` exports them, on every kernel backend name
# and ``auto`` (a backend an op does not have is reported "n/a"), with the backend's default tactic.
def future_cases(attr: str, norm_applies: bool) -> Callable[[], list]:
    """The op's default-tactic grid on each of its kernel backends and ``auto`` (none while the package lacks it):
    the seam backends that run the delayed seam, or a standalone op's own backends (``ops.OP_BACKENDS``)."""
    def cases():
        import mhc_cute
        from mhc_cute import ops

        if not hasattr(mhc_cute, attr):
            return []
        if attr in ops.OP_BACKENDS:
            names = [b for b in ops.OP_BACKENDS[attr] if b != "torch"]
        else:
            names = kernel_backends()
        return [c for b in names + ["auto"] for c in checkerboard(attr, b, norm_applies)]
    return cases


def delayed_cases() -> list[Case]:
    """The delayed seam's grid (``future_cases``) and, on the kernel paths, its entry forms with carried gates (the
    GPU tests run the broadcast entry with the identity): one and several tokens per CTA or tile."""
    from mhc_cute import tactics as tac

    cases = future_cases("mhc_fused_hc_delayed", True)()
    if cases:
        cases += [Case("mhc_fused_hc_delayed", b, m, h, norm, form) for b in kernel_backends()
                  if b in tac.FMA_PATHS + tac.MMA_PATHS for form in ENTRY_FORMS
                  for m, h, norm in ((3, 5120, True), (130, 512, False), (1031, 7168, True))]
    return cases


def _pre_mix(inputs: dict):
    import torch

    g = torch.Generator().manual_seed(1)
    res = inputs["residual_prev"]  # [M, 4, H], or the broadcast entry's [M, H]
    return (torch.sigmoid(torch.randn(res.shape[0], 4, generator=g)) + 1e-6).to(res.device)


def delayed_inputs(case, device):
    inputs = fused_hc_inputs(case, device)
    return dict(inputs, pre_mix_prev=_pre_mix(inputs))


def post_inputs(case, device):
    i = fused_hc_inputs(case, device)
    return dict(x=i["x_prev"], residual=i["residual_prev"], post_mix=i["post_mix_prev"], comb_mix=i["comb_mix_prev"])


def collapse_inputs(case, device):
    i = fused_hc_inputs(case, device)
    return dict(residual=i["residual_prev"], pre_mix=_pre_mix(i), norm_weight=i["norm_weight"])


def head_inputs(case, device):
    i = fused_hc_inputs(case, device)
    return dict(residual=i["residual_prev"], head_fn=i["fn"][:4].contiguous(), head_scale=i["hc_scale"][:1].clone(),
                head_base=i["hc_base"][:4].clone(), norm_weight=i["norm_weight"])


def plain_call(case: Case, inputs: dict):
    import mhc_cute

    return getattr(mhc_cute, case.op)(**inputs, backend=case.backend)


OPS: dict[str, OpSpec] = {
    "mhc_fused_hc": OpSpec(fused_hc_cases, fused_hc_inputs, fused_hc_call, fused_hc_check,
                           activations=("x_prev", "residual_prev", "post_mix_prev", "comb_mix_prev")),
    "mhc_fused_hc_delayed": OpSpec(delayed_cases, delayed_inputs, plain_call),
    "mhc_post": OpSpec(future_cases("mhc_post", False), post_inputs, plain_call),
    "mhc_collapse": OpSpec(future_cases("mhc_collapse", True), collapse_inputs, plain_call),
    "mhc_head": OpSpec(future_cases("mhc_head", True), head_inputs, plain_call),
}


def all_cases() -> list[Case]:
    cases = [c for spec in OPS.values() for c in spec.cases()]
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "two cases share a name"
    return cases


def select(cases: list[Case], ops=None, backends=None, shard: str | None = None, match=None) -> list[Case]:
    """The cases of ``ops`` on ``backends`` whose names contain one of the ``match`` strings (None: any), then
    every n-th of them for ``shard`` "i/n"."""
    cases = [c for c in cases if (not ops or c.op in ops) and (not backends or c.backend in backends)
             and (not match or any(s in c.name for s in match))]
    if shard:
        i, n = map(int, shard.split("/"))
        if not 1 <= i <= n:
            raise SystemExit(f"--shard {shard}: want i/n with 1 <= i <= n")
        cases = cases[i - 1::n]
    return cases


# --- the worker (one process, optionally under the sanitizer) -----------------------------------------------------

def _graph_call(spec: OpSpec, case: Case, inputs: dict, check: bool, device: str = "cuda"):
    """Capture one call in a CUDA graph (``benchmark.capture``: an eager call first, for compiles, prepared weights
    and scratch) and replay it on two new sets of activations copied into the captured ones; with ``check``, each
    replay equals an eager call on its inputs bit for bit. Returns the last replay's inputs and outputs."""
    import torch

    from mhc_cute.accuracy import same_bits
    from mhc_cute.benchmark import capture

    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    captured = []
    graph = capture(lambda s: captured.append(spec.call(case, s)), [static])
    for i in range(2):
        fresh = spec.inputs(replace(case, label=f"{case.label}-replay{i}"), device)
        for k in spec.activations:
            static[k].copy_(fresh[k])
        graph.replay()
        if device == "cuda":
            torch.cuda.synchronize()
        if check:
            assert same_bits(captured[-1], spec.call(case, static)), "a replay differs from the eager call"
    return static, captured[-1]


def run_case(case: Case, check: bool, device: str = "cuda") -> str:
    """Run one case; its status: ``ok``, ``n/a`` (the op has no such backend here), ``check: ...`` (off the
    contract), ``error: ...``, or ``fatal: ...`` (the CUDA context is unusable). ``device`` "cpu": the Triton
    interpreter and the reference (the tests')."""
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    spec = OPS[case.op]
    try:
        inputs = spec.inputs(case, device)
        if case.graph:  # the contract is checked on the inputs of the last replay
            inputs, out = _graph_call(spec, case, inputs, check, device)
        else:
            out = spec.call(case, inputs)
        sync()
        if check and spec.check is not None:
            spec.check(case, inputs, out)
        return "ok"
    except AssertionError as e:
        return "check: " + _first_line(e)
    except (ValueError, RuntimeError) as e:
        text = str(e)
        if "backend" in text and ("unknown" in text or "unavailable" in text or "needs H %" in text):
            return "n/a"
        status = "error: " + _first_line(e)
    except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
        status = "error: " + _first_line(e)
    try:
        sync()
    except Exception:  # noqa: BLE001 - a sticky CUDA error: nothing more can run in this process
        return "fatal: " + status.removeprefix("error: ")
    return status


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]


def worker(names: list[str], check: bool, device: str = "cuda", case_timeout: float = 0) -> int:
    """Run ``names`` once each between markers (``parse_output``); stop after a fatal one. A case still running
    after ``case_timeout`` seconds (0: no limit) ends the process with every thread's Python stack printed
    (``faulthandler``, which needs no GIL), so that a hang costs one case's time and shows where it waits."""
    import faulthandler

    by_name = {c.name: c for c in all_cases()}
    for name in names:
        print(f"{BEGIN} {name}", flush=True)
        if case_timeout > 0:
            faulthandler.dump_traceback_later(case_timeout, exit=True, file=sys.stdout)
        status = run_case(by_name[name], check, device)
        faulthandler.cancel_dump_traceback_later()
        print(f"{END} {name} {status}", flush=True)
        if status.startswith("fatal"):
            return FATAL_EXIT
    return 0


# --- the sanitizer's output -----------------------------------------------------------------------------------------

PREFIX = "========= "
_SUMMARY = re.compile(r"^========= ERROR SUMMARY: (\d+) errors?\b(?! were)")
_RACE_SUMMARY = re.compile(r"^========= RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
# sanitizer lines that are not the first line of a report
_NOT_A_REPORT = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target application",
                 "Error: process didn't terminate", "Saved host backtrace", "Program exited", "No ", "Note:")


_STACK_HEAD = re.compile(r"^Timeout \(\d+:\d\d:\d\d\)!")  # faulthandler's line before the stacks


class Parsed(NamedTuple):
    """What one sanitized process reported: the total of its ``ERROR SUMMARY`` lines (None when it printed none,
    i.e. it did not finish), racecheck warnings, the first line of each report per case (the case running or, between
    cases, the one that ran last; ``None``: before any), each case's status from the worker's markers, and the
    Python stack of a case the worker's ``case_timeout`` ended (its innermost frames)."""

    errors: int | None
    warnings: int
    reports: dict
    statuses: dict
    stacks: dict


def parse_output(text: str) -> Parsed:
    """Parse the merged stdout/stderr of a ``compute-sanitizer ... --worker`` process."""
    errors, race_errors, warnings = None, None, 0
    reports: dict = {}
    statuses: dict = {}
    stacks: dict = {}
    current = None  # the case running, else the last one that ran (a report may come after its end marker)
    stack = None  # the lines of a faulthandler dump being read
    for line in text.splitlines():
        if _STACK_HEAD.match(line):
            stack = stacks.setdefault(current, [])
            statuses[current] = "timed out"
            continue
        if stack is not None:
            if line.startswith(("Thread ", "Current thread ", "  File ")):
                stack.append(line.strip())
                continue
            stack = None
        if line.startswith(BEGIN + " "):
            current = line[len(BEGIN) + 1:].strip()
            statuses[current] = "running"
            continue
        if line.startswith(END + " "):
            name, _, status = line[len(END) + 1:].partition(" ")
            statuses[name] = status.strip()
            continue
        m = _SUMMARY.match(line)
        if m:
            errors = (errors or 0) + int(m.group(1))
            continue
        m = _RACE_SUMMARY.match(line)
        if m:
            race_errors = (race_errors or 0) + int(m.group(1))
            warnings += int(m.group(2))
            continue
        if line.startswith(PREFIX) and len(line) > len(PREFIX) and not line[len(PREFIX)].isspace():
            head = line[len(PREFIX):].strip()
            if not head.startswith(_NOT_A_REPORT):
                reports.setdefault(current, []).append(head)
    # racecheck (2025.3) ends with its own summary only
    return Parsed(race_errors if errors is None else errors, warnings, reports, statuses, stacks)


# --- the parent -----------------------------------------------------------------------------------------------------

def sanitizer_path(given: str | None) -> str | None:
    for candidate in (given, shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def tool_options(sanitizer: str, tool: str) -> list[str]:
    """Options beyond the defaults, each only where this compute-sanitizer knows it: device-side backtraces only
    (the host ones are Python frames). Initcheck's report of allocations never wholly used stays at its default, off
    (torch's caching allocator leaves most of each segment unused): passing ``--track-unused-memory no`` made every
    initcheck process exit at once on the H200 machine (2026-12-04)."""
    help_text = subprocess.run([sanitizer, "--help"], capture_output=True, text=True).stdout
    opts = []
    if "--show-backtrace" in help_text:
        opts += ["--show-backtrace", "device"]
    return opts


def cute_specs(cases: list[Case], sm_count: int):
    """(FMA specs, MMA specs) of the CuTe cases, in ``kernels.fma/mma.precompile``'s form."""
    call_specs = precompile_script.call_specs
    fma, mma = [], []
    for c in cases:
        if c.op not in ("mhc_fused_hc", "mhc_fused_hc_delayed"):
            continue
        seam = "carried" if c.op == "mhc_fused_hc_delayed" else None  # delayed_inputs carries gates
        f, m = call_specs(c.backend, c.tactic, c.m, c.h, "bfloat16" if c.norm else None, c.precision, seam,
                          case_form(c), sm_count)
        fma += f
        mma += m
    return list(dict.fromkeys(fma)), list(dict.fromkeys(mma))


def precompile(cases: list[Case], sm_count: int, workers: int) -> None:
    fma_specs, mma_specs = cute_specs(cases, sm_count)
    precompile_script.compile_seam_kernels(fma_specs, mma_specs, workers)


def run_bounded(cmd: list[str], env: dict, timeout: float) -> tuple[str, int | None, bool]:
    """(output, exit status or None, hung) of ``cmd`` run for at most ``timeout`` seconds. It runs in a process group
    of its own, killed whole on timeout: the sanitized worker is the sanitizer's child and holds the output pipe, so
    killing the sanitizer alone would leave the read waiting on the worker."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(ROOT),
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out, proc.returncode, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return out or "", None, True


def _innermost(stack: list[str], frames: int = 6) -> list[str]:
    """The innermost ``frames`` frames of the main thread in a faulthandler dump (innermost first; threads newest
    first, so the main thread is the last one, as the timer's dump names no current thread)."""
    heads = [i for i, line in enumerate(stack) if line.startswith(("Thread ", "Current thread "))]
    lines = stack[heads[-1] + 1:] if heads else stack
    out = []
    for line in lines:
        if not line.startswith("File "):
            break
        out.append(line)
    return out[:frames]


class Runner:
    """Launches worker processes for (tool, cases) and collects per-case results, within a time budget."""

    def __init__(self, sanitizer, chunk, timeout, budget, print_limit, case_timeout=0):
        self.sanitizer, self.chunk, self.timeout, self.print_limit = sanitizer, chunk, timeout, print_limit
        self.case_timeout = case_timeout
        self.deadline = time.monotonic() + budget
        self.options = {}

    def command(self, tool: str | None, names: list[str]) -> list[str]:
        worker_cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--cases", ",".join(names),
                      "--case-timeout", str(self.case_timeout)]
        if tool is None:
            return worker_cmd + ["--check"]
        if tool not in self.options:
            self.options[tool] = tool_options(self.sanitizer, tool)
        return [self.sanitizer, "--tool", tool, "--error-exitcode", str(ERROR_EXITCODE), "--print-limit",
                str(self.print_limit), *self.options[tool], *worker_cmd]

    def run(self, tool: str | None, cases: list[Case]) -> dict:
        """{case name: {"status", "errors" (None when unsanitized), "reports" (the first few)}}; the cases left
        when the budget ran out are absent. Graph cases run in processes of their own (caching allocator on)."""
        results = {}
        plain = [c.name for c in cases if not c.graph]
        graphs = [c.name for c in cases if c.graph]
        for group, caching in ((plain, tool not in ("memcheck", "initcheck")), (graphs, True)):
            for i in range(0, len(group), self.chunk):
                self._run_chunk(tool, group[i:i + self.chunk], caching, results)
        return results

    def _run_chunk(self, tool, names, caching, results):
        """Run ``names`` in one process; after a process that died or hung, the rest in a new one."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not caching:
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        while names:
            left = self.deadline - time.monotonic()
            if left < 30:
                return
            t0 = time.monotonic()
            text, rc, hung = run_bounded(self.command(tool, names), env, min(self.timeout, left))
            cut = hung and left <= self.timeout  # the sweep's budget ended it, not its own time limit
            parsed = parse_output(text)
            ran = [n for n in names if n in parsed.statuses]
            print(f"  {tool or 'unsanitized'}: {len(ran)}/{len(names)} cases in {time.monotonic() - t0:.0f} s "
                  f"(exit {rc}{', hung' if hung else ''})", flush=True)
            if not ran:  # nothing started (the sanitizer or the interpreter failed): the tail says why
                for n in names:
                    results[n] = {"status": f"no start (exit {rc}): {text.strip()[-300:]}",
                                  "errors": 0 if tool else None, "reports": []}
                return
            for n in ran:
                status = parsed.statuses[n]
                if status == "running":  # a case the budget's end interrupted ran for too short a time to tell
                    status = BUDGET_END if cut else "hung" if hung else f"died (exit {rc})"
                reports = parsed.reports.get(n, [])
                results[n] = {"status": status, "errors": len(reports) if tool else None, "reports": reports[:5]}
                if n in parsed.stacks:  # the main thread's innermost frames: where the case waited
                    results[n]["stack"] = _innermost(parsed.stacks[n])
            if tool is not None:
                # reports before the first case, and those the summary counts but the print limit kept back, are
                # charged to the last case that printed one (the limit was reached there or after), else the last
                # case that ran
                printed = sum(map(len, parsed.reports.values()))
                extra = len(parsed.reports.get(None, []))
                if parsed.errors is not None:
                    extra += max(0, parsed.errors + parsed.warnings - printed)
                last = results[next((n for n in reversed(ran) if parsed.reports.get(n)), ran[-1])]
                if extra:
                    last["errors"] += extra
                    last["reports"] = (last["reports"] + parsed.reports.get(None, []))[:5]
                    last["reports"].append(f"(+{extra} reports before the first case or not printed)")
                if parsed.errors is None and not hung:
                    last["status"] += " (no sanitizer summary)"
            names = [n for n in names if n not in parsed.statuses]


BUDGET_END = "stopped by the budget's end"  # in progress when the sweep's time was up: not run, not a finding


def finding(entry: dict | None) -> bool:
    """Whether a result is a finding: a report, or a status other than ``ok`` / ``n/a`` (or ``BUDGET_END``)."""
    return entry is not None and (entry["status"] not in ("ok", "n/a", BUDGET_END) or bool(entry.get("errors")))


def not_run(entry: dict | None) -> bool:
    """Whether a result counts as not run: absent, or cut by the budget's end without a report."""
    return entry is None or (entry["status"] == BUDGET_END and not entry.get("errors"))


def cell(entry: dict | None) -> str:
    if not_run(entry):
        return "-"
    status = entry["status"]
    if status == "n/a":
        return "n/a"
    if entry.get("errors") is None:  # the unsanitized pass
        return "ok" if status == "ok" else "FAIL"
    mark = "" if status == "ok" else ("!" if status.startswith(("check", "error")) else "X")
    return f"{entry['errors']}{mark}"


def print_table(results: dict, names: list[str], tools: list[str]) -> tuple[int, int]:
    """The table (case x the unsanitized check and the tools), then each finding's reports; returns
    (findings, pairs not run)."""
    columns = (["check"] if "check" in results else []) + tools
    width = max([len(n) for n in names] + [4])
    print(f"\n{'case':<{width}}  " + "  ".join(f"{c:>9}" for c in columns))
    findings = missing = 0
    for name in names:
        row = [results.get(col, {}).get(name) for col in columns]
        findings += sum(map(finding, row))
        missing += sum(map(not_run, row))
        print(f"{name:<{width}}  " + "  ".join(f"{cell(e):>9}" for e in row))
    print("\ncells: the reports (errors and racecheck warnings) of the tool; ! the call failed or missed the contract, "
          "X the process died or hung in it, - not run (or cut by the budget's end), n/a no such backend; check: the "
          "unsanitized pass")
    for col in columns:
        for name in names:
            e = results.get(col, {}).get(name)
            if finding(e):
                print(f"\n[{col}] {name}: {e['status']}, {e.get('errors')} reports")
                for r in e.get("reports", []):
                    print(f"    {r}")
                for frame in e.get("stack", []):
                    print(f"    stack: {frame}")
    return findings, missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the selected cases and exit")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, of {','.join(TOOLS)}")
    ap.add_argument("--backends", help="comma-separated backend names (default: all)")
    ap.add_argument("--ops", help=f"comma-separated, of {','.join(OPS)} (default: all)")
    ap.add_argument("--shard", help="i/n: every n-th case from the i-th (1-based), to split the sweep over calls")
    ap.add_argument("--match", help="comma-separated: only the cases whose names contain one of these")
    ap.add_argument("--json", help="write the results here (merge shards with --merge)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="print one table from results files and exit")
    ap.add_argument("--budget", type=float, default=540, help="seconds: launch no process after this (default 540)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per process before it counts as hung")
    ap.add_argument("--case-timeout", type=float, default=150,
                    help="seconds one case may run before its process prints its stack and ends (0: no limit)")
    ap.add_argument("--chunk", type=int, default=64, help="cases per sanitized process")
    ap.add_argument("--print-limit", type=int, default=100, help="reports a sanitized process prints")
    ap.add_argument("--sanitizer", help="path of compute-sanitizer (default: PATH, then /usr/local/cuda/bin)")
    ap.add_argument("--sm-count", type=int, default=None, help="SMs of the target GPU for --precompile-only "
                    "(default: this GPU's, else 132)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="processes for the precompile")
    ap.add_argument("--precompile-only", action="store_true", help="compile the selected cases' CuTe kernels, exit")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the unsanitized pass")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

    if args.worker:
        return worker(args.cases.split(","), args.check, args.device, args.case_timeout)
    tools = [t for t in args.tools.split(",") if t]
    if bad := [t for t in tools if t not in TOOLS]:
        ap.error(f"unknown tools {bad}; have {TOOLS}")
    if args.merge:
        merged, names = {}, []
        for path in args.merge:
            data = json.loads(Path(path).read_text())
            for col, rows in data["results"].items():
                merged.setdefault(col, {}).update(rows)
            names += [n for n in data["cases"] if n not in names]
        findings, missing = print_table(merged, names, [t for t in TOOLS if t in merged])
        print(f"sanitize: {len(names)} cases, {findings} findings, {missing} not run")
        return 1 if findings else (2 if missing else 0)

    cases = select(all_cases(), args.ops and args.ops.split(","), args.backends and args.backends.split(","),
                   args.shard, args.match and args.match.split(","))
    if args.list:
        for c in cases:
            print(f"{c.name:<58} {c.tactic or '(default)'}")
        print(f"{len(cases)} cases")
        return 0
    os.environ.setdefault("MHC_CUTE_KERNEL_CACHE", DEFAULT_KERNEL_CACHE)
    t0 = time.monotonic()
    if not args.no_precompile:
        sm_count = args.sm_count
        if sm_count is None:
            import torch

            sm_count = (torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available()
                        else SM_COUNT)
        precompile(cases, sm_count, args.workers)
    if args.precompile_only:
        return 0
    sanitizer = sanitizer_path(args.sanitizer)
    if sanitizer is None and tools:
        print("compute-sanitizer not found (give --sanitizer)", file=sys.stderr)
        return 2
    runner = Runner(sanitizer, args.chunk, args.timeout, args.budget - (time.monotonic() - t0), args.print_limit,
                    args.case_timeout)
    results = {}
    if not args.no_check:
        print(f"unsanitized pass: {len(cases)} cases", flush=True)
        results["check"] = runner.run(None, cases)
    for tool in tools:
        print(f"{tool}: {len(cases)} cases", flush=True)
        results[tool] = runner.run(tool, cases)
    names = [c.name for c in cases]
    findings, missing = print_table(results, names, tools)
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": names, "results": results,
                                               "argv": sys.argv[1:]}, indent=1))
    print(f"sanitize: {len(cases)} cases x {len(tools)} tools, {findings} findings, {missing} not run "
          f"({time.monotonic() - t0:.0f} s)")
    return 1 if findings else (2 if missing else 0)


if __name__ == "__main__":
    sys.exit(main())
