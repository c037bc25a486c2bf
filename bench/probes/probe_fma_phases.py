"""Where path E's kernel 1 spends its time at small M: the shipped tactic against variants of it that skip one
phase or more (the weight loads, the post-map's global loads and stores, the cross-thread reduction of the register
tiles; that last one applies to the FFMA projection only), timed as whole calls (CUDA-graph replay over rotated
input and weight sets, as the benchmark does) and as kernel-1 durations and tails (CUPTI kernel timestamps through
``torch.profiler``). The variants compute wrong results: they are for timing only, and run only here.

    python bench/probes/probe_fma_phases.py --compile-only    # any machine: compile and persist the variants
    python bench/probes/probe_fma_phases.py                   # on the GPU (with the same $MHC_CUTE_KERNEL_CACHE)
"""

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402

from mhc_cute import benchmark as mb, selector, tactics as tac  # noqa: E402
from mhc_cute.kernels import CompiledKernels, fma, spec_problem  # noqa: E402
from mhc_cute.tactics import SUMSQ_COL  # noqa: E402

SKIPPABLE = ("weights", "post", "reduce")
VARIANTS = ((), ("weights",), ("post",), ("reduce",), ("weights", "post"), ("weights", "post", "reduce"))
PROBE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]  # persisted variants follow this file


class PhaseProbe(fma.FmaFusedHc):
    """``FmaFusedHc`` with the phases in ``SKIP`` replaced by register fills (set per subclass: ``variant``)."""

    SKIP: tuple = ()

    @cute.jit
    def load_weights(self, weights: cute.Tensor, mFn: cute.Tensor, row0, row_step: int, fn_quad):
        if cutlass.const_expr("weights" in self.SKIP):
            tidx, _, _ = cute.arch.thread_idx()
            for i in cutlass.range_constexpr(cute.size(weights)):
                weights[i] = Float32(tidx + fn_quad + row0 + i) * Float32(1e-3)
        else:
            fma.FmaFusedHc.load_weights(self, weights, mFn, row0, row_step, fn_quad)

    @cute.jit
    def post_map(self, m0, h0, coefs: cute.Tensor, mX, mRes, mResCur, sAct: cute.Tensor, mLayerIn, x1_sumsq):
        if cutlass.const_expr("post" in self.SKIP):
            tidx, _, _ = cute.arch.thread_idx()
            for r in cutlass.range_constexpr(self.post_rounds):
                task = tidx + r * self.threads
                if task < self.post_tasks:
                    t, o = task // self.octets, task % self.octets
                    for j in cutlass.range_constexpr(fma.HC_MULT):
                        cute.local_tile(sAct[t, j, None], (8,), (o,)).fill(Float32(task + h0) * Float32(1e-3))
        else:
            fma.FmaFusedHc.post_map(self, m0, h0, coefs, mX, mRes, mResCur, sAct, mLayerIn, x1_sumsq)

    @cute.jit
    def write_partials(self, m0, split, acc: cute.Tensor, sumsq: cute.Tensor, sRed: cute.Tensor,
                       mPartials: cute.Tensor):
        if cutlass.const_expr("reduce" in self.SKIP):
            # each column group's first thread writes its own tile: no shuffles, no shared memory, no barrier
            tidx, _, _ = cute.arch.thread_idx()
            group = tidx // self.group_threads
            if tidx % self.group_threads == 0:
                for t in cutlass.range_constexpr(self.tokens):
                    if m0 + t < mPartials.shape[1]:
                        for i in cutlass.range_constexpr(self.tile_n):
                            mPartials[split, m0 + t, group * self.tile_n + i] = acc[t, i]
                        mPartials[split, m0 + t, SUMSQ_COL] = sumsq[t]
        else:
            fma.FmaFusedHc.write_partials(self, m0, split, acc, sumsq, sRed, mPartials)


def variant_name(skip: tuple) -> str:
    return "full" if not skip else "no_" + "_".join(skip)


def probe_class(skip: tuple):
    return type(f"PhaseProbe_{variant_name(skip)}", (PhaseProbe,), {"SKIP": skip})


_compiled = {skip: CompiledKernels(f"mhc_probe_{variant_name(skip)}") for skip in VARIANTS}


def compiled_variant(skip: tuple, tactic, hidden: int):
    problem = spec_problem(hidden, "fp32", None)
    out = problem.empty_outputs()
    return _compiled[skip].get((tactic, hidden, None, PROBE_DIGEST),
                               lambda: fma.compile_fma(tactic, problem, out, probe_class(skip)))


def shipped_tactic(m: int, hidden: int):
    """What ``auto`` runs on an H200 without the norm (the shipped table's row for M's bucket)."""
    from mhc_cute import __version__

    key = selector.TuneKey("NVIDIA H200", 132, hidden, "fp32", False, __version__).as_str()
    choice = selector.nearest(selector.load_shipped_tables()[key], selector.bucket_of(m))
    assert choice.backend == "half_fma", choice
    return tac.parse_tactic(choice.tactic)


def kernel_times(graph, calls: int) -> tuple[float, float]:
    """Median kernel-1 duration and median time from kernel 1's end to the big fuse's end, µs (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    k1 = [e for e in events if "BigFuse" not in e["name"]]
    fuse = [e for e in events if "BigFuse" in e["name"]]
    n = min(len(k1), len(fuse))
    tail = [fuse[i]["ts"] + fuse[i]["dur"] - k1[i]["ts"] - k1[i]["dur"] for i in range(n)]
    return statistics.median(e["dur"] for e in k1), statistics.median(tail)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--tactics", nargs="*", default=None, help="path E tactic names (default: the shipped picks)")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    tactics = ([tac.parse_tactic(t) for t in args.tactics] if args.tactics
               else [shipped_tactic(m, args.hidden) for m in args.m])
    for tactic in dict.fromkeys(tactics):
        for skip in VARIANTS:
            compiled_variant(skip, tactic, args.hidden)
    if args.compile_only:
        print(f"compiled {len(VARIANTS)} variants of {len(set(tactics))} tactics at H = {args.hidden}")
        return
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, H = {args.hidden}; us per call (graph replay, rotated sets), kernel-1 "
          f"duration and kernel-1 end to big-fuse end (CUPTI medians)")
    for m, tactic in zip(args.m, tactics):
        sets = mb.rotated_sets(m, args.hidden, dev)
        call = mb.mhc_cute_call("half_fma", tactic=tactic)
        key = (tactic, args.hidden, None)
        real = fma._compiled._fns.get(key) or fma.compiled_fma(tactic, spec_problem(args.hidden, "fp32", None),
                                                               spec_problem(args.hidden, "fp32", None).empty_outputs())
        for rnd in range(args.rounds):
            for skip in VARIANTS:
                fma._compiled._fns[key] = compiled_variant(skip, tactic, args.hidden)
                graph_us = mb.time_graph(call, sets, reps=30)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for s in sets:
                        call(s)
                k1, tail = kernel_times(graph, len(sets))
                print(f"PHASE M={m} {tactic.name} {variant_name(skip):24s} round {rnd} call {graph_us:6.2f} "
                      f"k1 {k1:5.2f} tail {tail:5.2f}", flush=True)
                del graph
        fma._compiled._fns[key] = real


if __name__ == "__main__":
    main()
