"""Where path E's tail goes at small M: the time from the end of kernel 1 to the end of the big fuse (3.4-3.6 us at
every M from 1 to 64 on the H200, bench/measured/h200_small_m_timeline_66d0a25_2026-12-02.txt), split by timestamps that
a copy of `auto`'s kernels writes into the workspace past the partials: each kernel-1 CTA's end (``%globaltimer``), and
per big-fuse CTA its start and its release from ``griddepcontrol_wait`` (``%globaltimer``), then ``clock64`` cycles
(same SM) to the partials summed, the Sinkhorn warp's start and end, and the first collapse warp's end. Run as `auto`
would (the shipped tactic, CUDA-graph replay over rotated inputs); the stamps of the last call of each replay are read.
The outputs are not checked: for timing only.

    python bench/probes/probe_big_fuse_tail.py --m 1 16 32 --hidden 7168 --repeat 1 20     # on a GPU machine
"""

import argparse
import hashlib
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "probes")]

import torch  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402

from mhc_cute import benchmark as mb, tactics as tac  # noqa: E402
from mhc_cute.kernels import CompiledKernels, fma, scalar_args, spec_problem  # noqa: E402
from mhc_cute.kernels.big_fuse import BigFuseKernel, BigFusePhase, standalone_big_fuse  # noqa: E402
from probe_fma_phases import shipped_tactic  # noqa: E402

PROBE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
K1_SLOTS = 4096  # kernel-1 CTA end stamps (Int32 words) after the partials; then 8 words per big-fuse CTA
FIELDS = ("gt_start", "gt_released", "clk_released", "clk_summed", "clk_sk_start", "clk_sk_end", "clk_collapsed",
          "gt_end")


def stamps_view(mPartials: cute.Tensor, split_k: int):
    """Int32 words past the partials of the flat workspace: [K1_SLOTS] kernel-1 ends, then [M, 8] big-fuse stamps."""
    m = mPartials.shape[1]
    base = cute.recast_ptr(mPartials.iterator + split_k * m * tac.PARTIAL_COLS, dtype=Int32)
    return cute.make_tensor(base, cute.make_layout(K1_SLOTS + 8 * m))


class TailPhase(BigFusePhase):
    """``BigFusePhase`` that records clock64 stamps of its steps (``stamps``/``slot`` set by the kernel)."""

    @cute.jit
    def sum_partials(self, storage, m0, mPartials):
        BigFusePhase.sum_partials(self, storage, m0, mPartials)
        tidx, _, _ = cute.arch.thread_idx()
        stamps, slot = self.stamps, self.slot
        if tidx == 0:
            stamps[slot + 3] = Int32(cute.arch.clock64())

    @cute.jit
    def sinkhorn(self, storage, m0, mCombOut, scalars):
        t0 = cute.arch.clock64()
        BigFusePhase.sinkhorn(self, storage, m0, mCombOut, scalars)
        tidx, _, _ = cute.arch.thread_idx()
        stamps, slot, first_lane = self.stamps, self.slot, (self.warps - 1) * 32
        if tidx == first_lane:  # the Sinkhorn warp's first lane (one token per CTA)
            stamps[slot + 4] = Int32(t0)
            stamps[slot + 5] = Int32(cute.arch.clock64())

    @cute.jit
    def collapse(self, storage, m0, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars, first, norm_w):
        BigFusePhase.collapse(self, storage, m0, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars, first,
                              norm_w)
        tidx, _, _ = cute.arch.thread_idx()
        stamps, slot = self.stamps, self.slot
        if tidx == 0:
            stamps[slot + 6] = Int32(cute.arch.clock64())


class TailBigFuse(BigFuseKernel):
    def __init__(self, reference: BigFuseKernel):
        p = reference.phase
        self.phase = TailPhase(p.hidden, p.split_k, p.tokens, p.threads, p.norm_dtype, p.batch,
                               sinkhorn_warp=p.sinkhorn_warp, pair_sinkhorn=p.pair_sinkhorn, delayed=p.delayed)

    @cute.kernel
    def kernel(self, mPartials, mScale, mBase, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars, mPreOut):
        bidx, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        phase = self.phase
        stamps, slot = stamps_view(mPartials, phase.split_k), K1_SLOTS + 8 * bidx
        phase.stamps, phase.slot = stamps, slot
        gt0 = cute.arch.globaltimer_lo()
        smem = cutlass.memory.SmemAllocator()
        storage = phase.allocate(smem)
        norm_w = phase.prefetch(storage, mScale, mBase, mNormW)
        cute.arch.griddepcontrol_wait()
        if tidx == 0:
            stamps[slot] = gt0
            stamps[slot + 1] = cute.arch.globaltimer_lo()
            stamps[slot + 2] = Int32(cute.arch.clock64())
        phase.run(storage, bidx * phase.tokens, mPartials, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars,
                  norm_w, mPreOut)
        cute.arch.sync_threads()
        if tidx == 0:
            stamps[slot + 7] = cute.arch.globaltimer_lo()


class TailProbe(fma.FmaFusedHc):
    """Path E with ``TailBigFuse`` and a globaltimer stamp at the end of every kernel-1 CTA."""

    def __init__(self, tactic, hidden, norm_dtype, delayed=None):
        super().__init__(tactic, hidden, norm_dtype, delayed)
        self.big_fuse = TailBigFuse(standalone_big_fuse(hidden, tactic.split_k, norm_dtype, tactic.fuse,
                                                        delayed is not None))

    @cute.jit
    def store_partials(self, m0, split, sRed, mPartials):
        fma.FmaFusedHc.store_partials(self, m0, split, sRed, mPartials)
        cute.arch.sync_threads()
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        stamps, slot = stamps_view(mPartials, self.split_k), (block * self.split_k + split) % K1_SLOTS
        if tidx == 0:
            stamps[slot] = cute.arch.globaltimer_lo()


_compiled = CompiledKernels("mhc_probe_tail")


def compiled_probe(tactic, hidden: int):
    problem = spec_problem(hidden, "fp32", None)
    return _compiled.get((tactic, hidden, PROBE_DIGEST),
                         lambda: fma.compile_fma(tactic, problem, problem.empty_outputs(), TailProbe))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock to turn clock64 cycles into us")
    ap.add_argument("--repeat", type=int, nargs="+", default=[20],
                    help="sinkhorn_repeat values to run (1 and 20 split the Sinkhorn warp's iterations from the rest)")
    args = ap.parse_args(argv)
    from mhc_cute.problem import Scalars, validate

    if not torch.cuda.is_available():
        for m in args.m:
            compiled_probe(shipped_tactic(m, args.hidden), args.hidden)
        print("compiled (no GPU: nothing timed)")
        return 2
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name()}; us from clock64 at {args.clock_ghz} GHz")
    for m, repeat in ((m, r) for m in args.m for r in args.repeat):
        tactic = shipped_tactic(m, args.hidden)
        fn = compiled_probe(tactic, args.hidden)
        sets = mb.rotated_sets(m, args.hidden, dev, False)[:16]
        ws = torch.zeros(tactic.split_k * m * tac.PARTIAL_COLS + K1_SLOTS + 8 * m + 64, dtype=torch.float32,
                         device=dev)
        stamps = ws[tactic.split_k * m * tac.PARTIAL_COLS:].view(torch.int32)

        def call(s):
            problem, _ = validate(s["x_prev"], s["residual_prev"], s["post_mix_prev"], s["comb_mix_prev"], s["fn"],
                                  s["hc_scale"], s["hc_base"], None, Scalars(sinkhorn_repeat=repeat), "fp32")
            out = problem.empty_outputs()
            fn(problem.x, problem.residual, problem.post_mix, problem.comb_mix, problem.fn, problem.hc_scale,
               problem.hc_base, None, *out, ws, None, None, None, *scalar_args(problem.scalars))

        for s in sets[:2]:
            call(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for s in sets:
                call(s)
        n_k1 = -(-m // tactic.tokens_per_cta) * tactic.split_k
        rows = []
        for _ in range(args.replays):
            stamps.zero_()
            graph.replay()
            torch.cuda.synchronize()
            st = stamps.cpu().tolist()
            k1 = st[:n_k1]
            bf = [dict(zip(FIELDS, st[K1_SLOTS + 8 * t: K1_SLOTS + 8 * t + 8])) for t in range(m)]
            k1_end = max(k1)
            cyc = args.clock_ghz * 1e3  # cycles per us
            for b in bf:
                rows.append({
                    "release after k1 end": (b["gt_released"] - k1_end) / 1e3,
                    "start before k1 end": (k1_end - b["gt_start"]) / 1e3,
                    "partials summed": (b["clk_summed"] - b["clk_released"]) / cyc,
                    "Sinkhorn warp start": (b["clk_sk_start"] - b["clk_released"]) / cyc,
                    "Sinkhorn warp end": (b["clk_sk_end"] - b["clk_released"]) / cyc,
                    "collapse warp 0 end": (b["clk_collapsed"] - b["clk_released"]) / cyc,
                    "CTA end after release": (b["gt_end"] - b["gt_released"]) / 1e3,
                    "CTA end after k1 end": (b["gt_end"] - k1_end) / 1e3,
                })
        print(f"M={m} H={args.hidden} sinkhorn_repeat={repeat} {tactic.name}: medians over {args.replays} replays "
              f"x {m} big-fuse CTAs "
              f"(us; clock64 ones from the CTA's release)", flush=True)
        for k in rows[0]:
            v = [r[k] for r in rows]
            print(f"  {k:24s} median {statistics.median(v):7.3f}  p10 {sorted(v)[len(v) // 10]:7.3f}  "
                  f"p90 {sorted(v)[len(v) * 9 // 10]:7.3f}", flush=True)
        gts = sorted({r["release after k1 end"] for r in rows})
        print(f"  (distinct globaltimer release offsets: {len(gts)}; smallest steps show its resolution)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
