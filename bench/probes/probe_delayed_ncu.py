"""Why does the delayed seam's kernel 1 stream slower than the V4 seam's? One warm and one measured call of each
(``mhc_fused_hc`` then ``mhc_fused_hc_delayed`` with carried gates, the same backend and inputs), for ``ncu`` to
profile the measured calls' kernel 1 side by side:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats -k regex:MmaFusedHc --launch-skip 2 --launch-count 2 \\
        python bench/probes/probe_delayed_ncu.py --backend half_mma --m 2048 --hidden 7168

``--post`` adds ``mhc_post`` on the same tokens after each seam (the post-map alone, which streams at the copy
rate): its kernel (``PostKernel``) for contrast with kernel 1's warp states.
"""

import argparse

import torch

from mhc_cute import benchmark as mb, mhc_fused_hc, mhc_fused_hc_delayed, mhc_post


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="half_mma")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--post", action="store_true", help="mhc_post on the same tokens after each seam")
    args = ap.parse_args()
    s = mb.with_carried_gates(mb.make_sets(args.m, args.hidden, 1, torch.device("cuda"), False))[0]
    v4 = {k: v for k, v in s.items() if k != "pre_mix_prev"}
    for _ in range(2):  # warm (compile, prepare the weight), then measured
        mhc_fused_hc(**v4, backend=args.backend)
        mhc_fused_hc_delayed(**s, backend=args.backend)
        if args.post:
            mhc_post(s["x_prev"], s["residual_prev"], s["post_mix_prev"], s["comb_mix_prev"])
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
