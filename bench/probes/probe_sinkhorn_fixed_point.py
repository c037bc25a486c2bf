"""Could the Sinkhorn stop early with the same bits? After how many iterations does ``device_utils.sinkhorn_4x4``'s
chain reach a bitwise fixed point (an iteration that leaves the scaling vectors u, v unchanged, after which every
further iteration returns the same bits)?

At M <= 32 the Sinkhorn's 19 iterations (about 1.2 µs) sit on the call's critical path; a loop that stops at the
fixed point would give the same output sooner. This emulates the kernel's fp32 chain on the CPU (the row softmax +
eps, then the scaling-vector steps in the kernel's order of FMAs; an FMA as one rounding of the float64 result,
``rcp.approx`` as the rounded reciprocal) for random 4 x 4 logits of several scales (the seam's comb logits are about
N(0, 1) with the benchmark's inputs) and reports, per scale, how many 4 x 4s reach the fixed point within
``repeat - 1`` iterations, the median iteration, and the share of 32-token blocks whose every token does (a block's
CTA or warp waits for its slowest token).

    python bench/probes/probe_sinkhorn_fixed_point.py      # no GPU needed

Lines: ``SK scale reached/n median max blocks_all_reached``.
"""

import argparse

import numpy as np

F32 = np.float32


def _fma(a, b, c):
    return F32(np.float64(a) * np.float64(b) + np.float64(c))


def _rcp(x):
    return F32(1.0 / np.float64(x))


def fixed_point_iteration(logits: np.ndarray, eps: float, repeat: int) -> int | None:
    """The first of the ``repeat - 1`` (row, column) iterations after which u and v are unchanged, or None."""
    eps = F32(eps)
    k = logits.astype(F32).reshape(4, 4).copy()
    for i in range(4):
        e = np.exp((k[i] - k[i].max()).astype(F32)).astype(F32)
        inv = _rcp(F32(F32(e[0] + e[1]) + F32(e[2] + e[3])))
        k[i] = [_fma(e[j], inv, eps) for j in range(4)]
    u, r, v, s = [F32(1)] * 4, [F32(1)] * 4, [F32(1)] * 4, [F32(1)] * 4

    def column_step():
        for j in range(4):
            top = _fma(k[1][j], r[1], _fma(k[0][j], r[0], F32(eps * v[j])))
            v[j] = F32(top + _fma(k[3][j], r[3], F32(k[2][j] * r[2])))
            s[j] = _rcp(v[j])

    def row_step():
        for i in range(4):
            left = _fma(k[i][1], s[1], _fma(k[i][0], s[0], F32(eps * u[i])))
            u[i] = F32(left + _fma(k[i][3], s[3], F32(k[i][2] * s[2])))
            r[i] = _rcp(u[i])

    column_step()
    for it in range(1, repeat):
        before = (list(u), list(v))
        row_step()
        column_step()
        if (list(u), list(v)) == before:
            return it
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--n", type=int, default=640, help="4 x 4s per scale (20 blocks of 32)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--eps", type=float, default=1e-6)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    for scale in args.scales:
        its = [fixed_point_iteration(rng.standard_normal(16) * scale, args.eps, args.repeat) for _ in range(args.n)]
        reached = [i for i in its if i is not None]
        blocks = [its[b:b + 32] for b in range(0, args.n - 31, 32)]
        whole = sum(all(i is not None for i in blk) for blk in blocks)
        median = f"{np.median(reached):.0f}" if reached else "-"
        print(f"SK scale={scale} reached {len(reached)}/{args.n} median {median} max {max(reached, default='-')} "
              f"blocks of 32 all reached {whole}/{len(blocks)}", flush=True)


if __name__ == "__main__":
    main()
