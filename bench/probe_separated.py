"""Two measures of a call that follows a kernel without PDL, side by side with the back-to-back graph time.

The kernel before each call (``--separator``): ``bump``, a one-element torch kernel; or ``gemm``, the sublayer's
output projection that writes the call's ``x_prev`` in a model (cuBLAS ``a @ w``, bf16), to see whether a real
predecessor lets the call start early. "sep" (``benchmark.time_graph_separated``): a graph of call + separator per
set, minus a graph of the separators alone. "after" (``time_graph_after_separator`` here): a graph of separator +
call per set, from kernel timestamps: the separator's end to the end of the call's last kernel (a lower bound of
what a lone call adds). For a backend without PDL (Triton, the torch peers) a lone call should take its
back-to-back time, which checks each measure.

    python bench/probe_separated.py --hidden 7168 --m 1 8 16 32 --names auto triton
    python bench/probe_separated.py --m 17 32 --separator bump gemm \
        --names auto half_fma:k224:t16:n6:w128:s1:b1:flat:mma

Lines: ``SEPV round separator name H M graph_us sep_us after_us gap_us first_kernel_us`` (gap: from the
separator's end to the call's first kernel's start; first_kernel: that kernel's duration).
"""

import argparse
import json
import statistics
import tempfile
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from mhc_cute import benchmark as mb


def _kernels_per_set(step: Callable[[dict], object], sets: list[dict], reps: int) -> list[list[dict]]:
    """The CUPTI kernel records of ``reps`` replays of a CUDA graph making ``step(s)`` for each set, grouped per
    step (each step must launch the same kernels every time)."""
    graph = mb.capture(step, sets)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        kernels = sorted((e for e in json.load(open(f.name))["traceEvents"] if e.get("cat") == "kernel"),
                         key=lambda e: e["ts"])
    per_step, rest = divmod(len(kernels), reps * len(sets))
    groups = [kernels[i:i + per_step] for i in range(0, len(kernels), per_step)]
    if rest or not per_step or len({tuple(e["name"] for e in g) for g in groups}) != 1:
        raise RuntimeError(f"{len(kernels)} kernels in {reps} replays of {len(sets)} steps do not split into "
                           "identical groups")
    return groups


def time_graph_after_separator(call: Callable[[dict], object], sets: list[dict],
                               separator: Callable[[dict], object], reps: int = 5) -> tuple[float, float, float]:
    """Medians (µs) over the calls of a CUDA graph of separator then call per set, replayed under
    ``torch.profiler`` (kernel timestamps from CUPTI): from the end of the separator's last kernel to the end of the
    call's last kernel ("after"); to the start of the call's first kernel ("gap": negative when a separator that
    triggers PDL let it launch early); and that first kernel's duration."""
    n_sep = len(_kernels_per_set(separator, sets[:1], 1)[0])

    def separator_then_call(s):
        separator(s)
        call(s)
    groups = _kernels_per_set(separator_then_call, sets, reps)
    if len(groups[0]) <= n_sep:
        raise RuntimeError("time_graph_after_separator: the call launched no kernel")
    sep_end = [max(e["ts"] + e["dur"] for e in g[:n_sep]) for g in groups]
    after = statistics.median(max(e["ts"] + e["dur"] for e in g[n_sep:]) - end for g, end in zip(groups, sep_end))
    gap = statistics.median(g[n_sep]["ts"] - end for g, end in zip(groups, sep_end))
    return after, gap, statistics.median(g[n_sep]["dur"] for g in groups)


def gemm_separator(sets: list[dict], k: int) -> Callable[[dict], None]:
    """The sublayer's output projection as the kernel before each call, as in a model: ``x_prev = a @ w``
    (cuBLAS, bf16; ``a`` [M, k] per set, ``w`` [k, H] shared), so the call reads what that kernel wrote."""
    m, hidden = sets[0]["x_prev"].shape
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(k, hidden, generator=g, device="cuda") / k ** 0.5).bfloat16()
    a = {id(s): torch.randn(m, k, generator=g, device="cuda").bfloat16() for s in sets}

    def gemm(s):
        torch.matmul(a[id(s)], w, out=s["x_prev"])
    return gemm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--names", nargs="+", default=["auto", "triton", "torch-compile"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--separator", choices=["bump", "gemm"], nargs="+", default=["bump"],
                    help="the kernel before each call: a one-element torch kernel, or cuBLAS's x_prev = a @ w")
    ap.add_argument("--gemm-k", type=int, default=7168, help="the GEMM separator's inner size")
    ap.add_argument("--norm", action="store_true", help="with the fused RMSNorm (norm_weight)")
    args = ap.parse_args()
    peers = mb.peer_calls(False)
    # a name with a colon is a tactic name (backend first): that tactic at every M
    calls = {n: peers[n] if n in peers else mb.mhc_cute_call(n.split(":")[0], tactic=n if ":" in n else None)
             for n in args.names}
    for r in range(args.rounds):
        for h in args.hidden:
            for m in args.m:
                sets = mb.rotated_sets(m, h, "cuda", args.norm)
                for kind in args.separator:
                    separator = mb.separator() if kind == "bump" else gemm_separator(sets, args.gemm_k)
                    separator_us = mb.time_graph(separator, sets)
                    for name, call in calls.items():
                        graph = mb.time_graph(call, sets)
                        sep = mb.time_graph_separated(call, sets, separator_us, separator)
                        after, gap, first = time_graph_after_separator(call, sets, separator)
                        label = kind + ("+norm" if args.norm else "")
                        print(f"SEPV r{r} {label} {name} {h} {m} {graph:.2f} {sep:.2f} {after:.2f} {gap:.2f} "
                              f"{first:.2f}", flush=True)
                del sets
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
