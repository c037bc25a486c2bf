"""Where the time of a small-M call goes, on the device: CUDA-graph replay µs per call of

* the launch floor: one and two trivial kernels per call (what any one- or two-launch path pays);
* each kernel backend's default tactic with the full Sinkhorn (``sinkhorn_repeat=20``) and with one
  iteration, with inputs rotated out of L2 (``cold``) and with two L2-resident sets (``hot``).

Differences between the columns place the time: ``r20 - r1`` is 19 Sinkhorn iterations on the critical path,
``cold - hot`` the HBM latency and bandwidth, ``hot - floor`` the rest of the chain (reductions, fences,
the election, the big fuse).

    python bench/probes/probe_latency.py --m 1 8 32 --hidden 7168

``--ncu-once`` instead makes one call per backend and M (for ``ncu --clock-control none``, which times each
kernel on its own with the caches flushed).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute.api import mhc_fused_hc  # noqa: E402

BACKENDS = ("all_fma", "half_fma", "half_mma", "triton")


def launch_floor_us(kernels_per_call: int, calls: int = 64) -> float:
    """µs per call of a graph of ``calls`` calls of ``kernels_per_call`` one-element kernels."""
    t = torch.zeros(1, device="cuda")

    def call(_):
        for _ in range(kernels_per_call):
            t.add_(1.0)
    return mb.time_graph(call, [None] * calls)


def backend_call(backend: str, repeat: int):
    def call(s):
        return mhc_fused_hc(**s, backend=backend, sinkhorn_repeat=repeat)
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS))
    ap.add_argument("--ncu-once", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    if args.ncu_once:
        for h in args.hidden:
            for m in args.m:
                s = mb.make_sets(m, h, 1, dev, False)[0]
                for b in args.backends:
                    for _ in range(2):  # the first call compiles and prepares the weight
                        backend_call(b, 20)(s)
                torch.cuda.synchronize()
        return
    print(f"GPU: {torch.cuda.get_device_name(dev)}")
    print(f"launch floor: 1 kernel {launch_floor_us(1):.2f} us/call, 2 kernels {launch_floor_us(2):.2f} us/call")
    print(f"{'H':>5} {'M':>5} {'backend':>9} | {'cold r20':>8} {'cold r1':>8} {'hot r20':>8} {'hot r1':>8}")
    for h in args.hidden:
        for m in args.m:
            cold = mb.rotated_sets(m, h, dev)
            hot = cold[:2]
            for b in args.backends:
                cells = [mb.time_graph(backend_call(b, rep), sets) for sets in (cold, hot) for rep in (20, 1)]
                print(f"{h:>5} {m:>5} {b:>9} | " + " ".join(f"{c:8.2f}" for c in cells), flush=True)
            del cold, hot
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
