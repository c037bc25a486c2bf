"""Two measures of a call that follows a kernel without PDL, side by side with the back-to-back graph time.

The kernel before each call (``--separator``): ``bump``, a one-element torch kernel; or ``gemm``, the sublayer's
output projection that writes the call's ``x_prev`` in a model (cuBLAS ``a @ w``, bf16), to see whether a real
predecessor lets the call start early. "sep" (``benchmark.time_graph_separated``): a graph of call + separator per
set, minus a graph of the separators alone. "after" (``benchmark.time_after``): a graph of separator +
call per set, from kernel timestamps: the separator's end to the end of the call's last kernel (a lower bound of
what a lone call adds). For a backend without PDL (Triton, the torch peers) a lone call should take its
back-to-back time, which checks each measure.

    python bench/probes/probe_separated.py --hidden 7168 --m 1 8 16 32 --names auto triton
    python bench/probes/probe_separated.py --m 17 32 --separator bump gemm \
        --names auto half_fma:k224:t16:n6:w128:s1:b1:flat:mma

Lines: ``SEPV round separator name H M graph_us sep_us after_us gap_us first_kernel_us`` (gap: from the
separator's end to the call's first kernel's start; first_kernel: that kernel's duration).
"""

import argparse

import torch

from mhc_cute import benchmark as mb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--names", nargs="+", default=["auto", "triton", "torch-compile"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--separator", choices=["bump", "gemm"], nargs="+", default=["bump"],
                    help="the kernel before each call: a one-element torch kernel, or cuBLAS's x_prev = a @ w")
    ap.add_argument("--gemm-k", type=int, default=mb.PREDECESSOR_GEMM_K, help="the GEMM separator's inner size")
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
                    separator = mb.separator() if kind == "bump" else mb.gemm_predecessor(sets, args.gemm_k)
                    separator_us = mb.time_graph(separator, sets)
                    for name, call in calls.items():
                        graph = mb.time_graph(call, sets)
                        sep = mb.time_graph_separated(call, sets, separator_us, separator)
                        after, gap, first = mb.time_after(call, sets, separator)
                        label = kind + ("+norm" if args.norm else "")
                        print(f"SEPV r{r} {label} {name} {h} {m} {graph:.2f} {sep:.2f} {after:.2f} {gap:.2f} "
                              f"{first:.2f}", flush=True)
                del sets
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
