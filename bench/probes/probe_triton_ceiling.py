"""How fast the Triton design's main kernel could be at large M, on the device: the main kernel's access pattern
(grid of K splits x token blocks, each program walking its H range in steps of ``block_h`` over x and the four
``residual_prev`` streams, storing four ``residual_cur`` tiles) without the projection, against the real main
kernel and the whole op in the same process.

Modes of the probe kernel: ``copy`` stores ``bf16(x + r_j)`` (the loads and stores, next to no arithmetic);
``postmap`` is SPEC step 1 as the main kernel computes it plus the sum of squares (one partial column per
split), i.e. the main kernel with its tensor-core projection left out; their ``-interleaved`` forms give split k
the blocks k, k + split_k, ... of H instead of a contiguous range. Each is timed (CUDA-graph replay, rotated
inputs, median) for several block shapes and reported as a fraction of the copy bandwidth for the main kernel's
18 H bytes per token, and as the whole op's fraction of the floor (20 H) that it would reach with the measured
reduce kernel after it. If even ``postmap`` with the reduce stays below a target, no projection can reach it in
this design.

    python bench/probes/probe_triton_ceiling.py --m 2048 8192 --hidden 7168
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from probe_triton_split import split_points  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute.triton.fused_hc import _load_inputs, _post_stream, _token_col as col  # noqa: E402

MODES = {"copy": 0, "postmap": 1, "copy-interleaved": 2, "postmap-interleaved": 3}
# (block_m, block_h, split_k, num_warps, num_stages); the first is the shipped large-M shape
SHAPES = [(64, 32, 8, 4, 4), (64, 32, 8, 4, 2), (32, 64, 8, 4, 4), (64, 64, 8, 4, 3), (32, 128, 8, 4, 3),
          (16, 128, 8, 4, 4), (64, 64, 8, 8, 3), (128, 32, 8, 8, 3)]


@triton.jit(do_not_specialize=["M", "blocks_per_split"])
def _probe_kernel(x_ptr, res_ptr, post_ptr, comb_ptr, res_out_ptr, sq_ptr, M, H, blocks_per_split,
                  BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, MODE: tl.constexpr, INTERLEAVE: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    tok = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_mask = tok < M
    rows = tok.to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    mask = tok_mask[:, None]
    x_row = rows[:, None] * H
    res_row = rows[:, None] * (4 * H)
    p0, p1 = col(post_ptr, rows, tok_mask, 4, 0), col(post_ptr, rows, tok_mask, 4, 1)
    p2, p3 = col(post_ptr, rows, tok_mask, 4, 2), col(post_ptr, rows, tok_mask, 4, 3)
    c00, c01 = col(comb_ptr, rows, tok_mask, 16, 0), col(comb_ptr, rows, tok_mask, 16, 1)
    c02, c03 = col(comb_ptr, rows, tok_mask, 16, 2), col(comb_ptr, rows, tok_mask, 16, 3)
    c10, c11 = col(comb_ptr, rows, tok_mask, 16, 4), col(comb_ptr, rows, tok_mask, 16, 5)
    c12, c13 = col(comb_ptr, rows, tok_mask, 16, 6), col(comb_ptr, rows, tok_mask, 16, 7)
    c20, c21 = col(comb_ptr, rows, tok_mask, 16, 8), col(comb_ptr, rows, tok_mask, 16, 9)
    c22, c23 = col(comb_ptr, rows, tok_mask, 16, 10), col(comb_ptr, rows, tok_mask, 16, 11)
    c30, c31 = col(comb_ptr, rows, tok_mask, 16, 12), col(comb_ptr, rows, tok_mask, 16, 13)
    c32, c33 = col(comb_ptr, rows, tok_mask, 16, 14), col(comb_ptr, rows, tok_mask, 16, 15)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    n_splits = tl.num_programs(0)
    block_begin = pid_k * blocks_per_split
    block_end = tl.minimum(block_begin + blocks_per_split, H // BLOCK_H)
    for i in range(block_begin, block_end):
        # INTERLEAVE: split k takes blocks k, k + n_splits, ..., so that the splits of a token block, which run at
        # the same time, read neighbouring pieces of each row
        hb = (i - block_begin) * n_splits + pid_k if INTERLEAVE else i
        h = hb * BLOCK_H + offs_h[None, :]
        xf, r0, r1, r2, r3 = _load_inputs(x_ptr, res_ptr, x_row, res_row, h, mask, H)
        if MODE == 0:
            o0 = (r0 + xf).to(tl.bfloat16)
            o1 = (r1 + xf).to(tl.bfloat16)
            o2 = (r2 + xf).to(tl.bfloat16)
            o3 = (r3 + xf).to(tl.bfloat16)
        else:
            o0 = _post_stream(xf, r0, r1, r2, r3, p0, c00, c10, c20, c30)
            o1 = _post_stream(xf, r0, r1, r2, r3, p1, c01, c11, c21, c31)
            o2 = _post_stream(xf, r0, r1, r2, r3, p2, c02, c12, c22, c32)
            o3 = _post_stream(xf, r0, r1, r2, r3, p3, c03, c13, c23, c33)
            f0, f1, f2, f3 = o0.to(tl.float32), o1.to(tl.float32), o2.to(tl.float32), o3.to(tl.float32)
            sq += tl.sum(f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3, axis=1)
        tl.store(res_out_ptr + res_row + h, o0, mask=mask)
        tl.store(res_out_ptr + res_row + H + h, o1, mask=mask)
        tl.store(res_out_ptr + res_row + 2 * H + h, o2, mask=mask)
        tl.store(res_out_ptr + res_row + 3 * H + h, o3, mask=mask)
    tl.store(sq_ptr + pid_k * M + rows, sq, mask=tok_mask)


def probe_call(mode: str, shape, m: int, h: int, dev):
    block_m, block_h, split_k, warps, stages = shape
    blocks_per_split = -(-(h // block_h) // split_k)
    out = torch.empty(m, 4, h, dtype=torch.bfloat16, device=dev)
    sq = torch.empty(split_k, m, dtype=torch.float32, device=dev)
    grid = (split_k, triton.cdiv(m, block_m))

    def call(s):
        _probe_kernel[grid](s["x_prev"], s["residual_prev"], s["post_mix_prev"], s["comb_mix_prev"], out, sq,
                            m, h, blocks_per_split, BLOCK_M=block_m, BLOCK_H=block_h, MODE=MODES[mode] % 2,
                            INTERLEAVE=MODES[mode] >= 2,
                            num_warps=warps, num_stages=stages)
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--modes", nargs="+", default=sorted(MODES), choices=sorted(MODES))
    ap.add_argument("--shapes", type=int, nargs="+", help="indices into SHAPES (default: all)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bw = mb.measure_copy_bandwidth(dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print("main: % of copy for 18 H bytes per token; op: % of the floor (20 H) with the measured reduce after it")
    for h, m, sets, whole, main_only in split_points(args.hidden, args.m, dev):
        reduce = whole - main_only
        main_floor = 18 * h * m / bw * 1e6
        op_floor = 20 * h * m / bw * 1e6

        def row(name, us):
            print(f"H={h} M={m} {name:<34} {us:8.1f} us  main {100 * main_floor / us:5.1f}%  "
                  f"op {100 * op_floor / (us + reduce):5.1f}%", flush=True)
        print(f"H={h} M={m} whole op {whole:.1f} us ({100 * op_floor / whole:.1f}% of the floor), "
              f"reduce {reduce:.1f} us", flush=True)
        row("main kernel (default tactic)", main_only)
        for mode in args.modes:
            for shape in [SHAPES[i] for i in args.shapes] if args.shapes else SHAPES:
                if h % shape[1] or (MODES[mode] >= 2 and (h // shape[1]) % shape[2]):
                    continue
                try:
                    us = mb.time_graph(probe_call(mode, shape, m, h, dev), sets)
                except Exception as e:  # a shape that does not compile or launch: reported, not fatal
                    print(f"H={h} M={m} {mode} {shape} ERROR {type(e).__name__} {str(e)[:160]}", flush=True)
                    continue
                row(f"{mode} {shape}", us)


if __name__ == "__main__":
    main()
