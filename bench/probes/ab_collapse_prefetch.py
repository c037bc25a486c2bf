"""``mhc_collapse`` with the norm: the CuTe kernel with the norm weight prefetched into registers against the one
that loads it in the second pass (``kernels.collapse``: ``prefetch_norm``), per H and M, CUDA-graph replay with the
inputs rotated out of L2, in alternating rounds; and which one ``run_collapse`` picks (by H).

    python bench/probes/ab_collapse_prefetch.py --hidden 7168 5120 --m 1 32 132 264 2048 8192

Lines: ``H M prefetch_us no_prefetch_us no/pre picked floor%_best``.
"""

import argparse
import statistics

import torch

from mhc_cute import benchmark as mb
from mhc_cute.accuracy import op_inputs_of
from mhc_cute.kernels import collapse, sm_count


def variant_call(prefetch: bool):
    def call(s):
        op = s["op"]
        res, pre, w = op["residual"], op["pre_mix"], op["norm_weight"]
        out = torch.empty(res.shape[0], res.shape[2], dtype=torch.bfloat16, device=res.device)
        fn = collapse.compiled_collapse(res, pre, w, out, prefetch)
        fn(res, pre, w, out, 1e-20)
        return out
    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 5120, 4096])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32, 132, 264, 512, 2048, 8192])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bandwidth = mb.measure_copy_bandwidth(dev)
    print(f"GPU {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; SMs {sm_count(0)}")
    for h in args.hidden:
        for m in args.m:
            sets = [dict(op=op_inputs_of("mhc_collapse", s))
                    for s in mb.with_carried_gates(mb.rotated_sets(m, h, dev, norm=True))]
            timers = {p: (lambda p=p: mb.time_graph(variant_call(p), sets)) for p in (True, False)}
            times = mb.alternating_rounds(timers, args.rounds)
            pre, no = (statistics.median(times[p]) for p in (True, False))
            picked = "prefetch" if collapse.prefetches_norm(h) else "no_prefetch"
            floor = mb.collapse_floor_bytes(m, h) / bandwidth * 1e6
            print(f"{h:6d} {m:6d} {pre:9.2f} {no:9.2f} {no / pre:6.3f} {picked:12s} {100 * floor / min(pre, no):5.1f}%",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
