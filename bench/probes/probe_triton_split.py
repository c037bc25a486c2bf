"""Where the Triton backend's time goes at large M, on the device: CUDA-graph replay µs per call of the whole
op and of its main kernel alone (the reduce kernel's launch replaced by nothing), rotated inputs, default
tactics, against the copy-bandwidth time of each kernel's own bytes (main: read x and residual_prev, write
residual_cur, 18 H bytes per token; reduce: read residual_cur, write layer_input, 10 H).

    python bench/probes/probe_triton_split.py --m 2048 8192 --hidden 7168
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute.api import mhc_fused_hc  # noqa: E402
from mhc_cute.triton import fused_hc  # noqa: E402


class _Skip:
    """Stands in for a jitted kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def split_points(hiddens, ms, dev):
    """For each (H, M): ``(h, m, sets, whole, main_only)``, the CUDA-graph µs per call of the Triton backend's
    whole op and of its main kernel alone (default tactics) on rotated input sets, freed after the caller's turn."""

    def call(s):
        return mhc_fused_hc(**s, backend="triton")

    reduce_kernel = fused_hc._reduce_kernel
    for h in hiddens:
        for m in ms:
            sets = mb.rotated_sets(m, h, dev)
            whole = mb.time_graph(call, sets)
            fused_hc._reduce_kernel = _Skip()
            try:
                main_only = mb.time_graph(call, sets)
            finally:
                fused_hc._reduce_kernel = reduce_kernel
            yield h, m, sets, whole, main_only
            del sets
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bw = mb.measure_copy_bandwidth(dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'H':>5} {'M':>6} | {'op us':>8} {'main us':>8} {'reduce us':>9} | main % of its floor, reduce %")

    for h, m, _, whole, main_only in split_points(args.hidden, args.m, dev):
        reduce = whole - main_only
        main_floor = 18 * h * m / bw * 1e6
        reduce_floor = 10 * h * m / bw * 1e6
        print(f"{h:>5} {m:>6} | {whole:8.1f} {main_only:8.1f} {reduce:9.1f} | "
              f"{100 * main_floor / main_only:5.1f}% {100 * reduce_floor / reduce:5.1f}%", flush=True)


if __name__ == "__main__":
    main()
