"""Does a large-M call get faster when its tokens run as consecutive smaller calls?

The two-kernel paths re-read ``residual_cur`` (8H of the 28H bytes per token they move) in their second kernel.
Run as one call, that re-read comes from HBM: the first kernel writes hundreds of MB before the second starts. Run
as calls of ``chunk`` tokens each, the second kernel of a chunk re-reads what the first wrote a few µs earlier,
which may still be in L2, at the price of a kernel ramp and tail per chunk. This probe times, in one process, the
same rotated inputs as one call and as chunked calls (slices of the inputs, CUDA-graph replay; each chunk call is
what ``mhc_fused_hc`` does for that many tokens, with its own choice of tactic under ``auto``).

    python bench/probes/probe_chunked.py --hidden 7168 --m 2048 8192 --chunks 256 512 1024 2048 --backends auto triton

Lines: ``CH backend H M chunk us floor_frac`` (chunk = M: one call).
"""

import argparse

import torch

from mhc_cute import benchmark
from mhc_cute.api import mhc_fused_hc

TOKEN_ARGS = ("x_prev", "residual_prev", "post_mix_prev", "comb_mix_prev")


def chunked_call(backend: str, chunk: int):
    def call(s):
        m = s["x_prev"].shape[0]
        for a in range(0, m, chunk):
            part = {k: (v[a:a + chunk] if k in TOKEN_ARGS else v) for k, v in s.items()}
            mhc_fused_hc(**part, backend=backend)
    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--m", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--backends", nargs="+", default=["auto", "triton"])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    bandwidth = benchmark.measure_copy_bandwidth("cuda")
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for r in range(args.rounds):
        for h in args.hidden:
            for m in args.m:
                sets = benchmark.rotated_sets(m, h, "cuda")
                for backend in args.backends:
                    for chunk in [m] + [c for c in args.chunks if c < m]:
                        us = benchmark.time_graph(chunked_call(backend, chunk), sets)
                        frac = benchmark.floor_bytes(m, h) / (us * 1e-6) / bandwidth
                        print(f"CH r{r} {backend} {h} {m} {chunk} {us:.1f} {frac:.3f}", flush=True)
                del sets
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
