"""What do grid-wide barriers cost on this GPU, alone and inside a streaming kernel? The open question of the
grid-persistent design sketched in docs/experiments.md, which needs two grid barriers per round of tokens and reaches
the issue's 80% only if they hide behind the round's memory traffic.

A kernel of ``--ctas`` CTAs (one per SM), launched cooperatively (all resident, so a spin barrier cannot deadlock),
runs ``rounds`` rounds. In each round every thread but the first warp's stores the ``--vectors`` 16-byte vectors it
loaded in the previous round to a destination buffer, issues the loads of the next round's vectors (in flight from
then on), and the CTA passes ``--barriers`` grid barriers: a streaming copy with barriers between its rounds, like
the persistent kernel (at H = 7168 and 96 tokens per round a CTA of 256 copying threads loads and stores about 13
vectors per thread per round). With ``--vectors 0`` it only passes barriers.

A barrier: a CTA barrier; the first thread announces the CTA's arrival on a global counter and spins until every
CTA of this barrier has arrived; a CTA barrier. The first warp copies nothing, as a scheduling warp of a
warp-specialised kernel would not: a release fence waits for the issuing thread's own loads in flight. ``atomic``:
fence, atomic add (release), polled with atomic adds of 0 (acquire); ``red``: a release reduction
(``red.release.gpu``), polled with acquire loads. The counter only grows (barrier k waits for ``(k + 1) * ctas``),
so the host zeroes it once per launch. ``--lags L``: also one split-phase barrier per round, each round ending
with a wait for every CTA's arrival of round r - L (the counter read at the round's start) and then the CTA's own
arrival, which only the barrier thread waits for (the shape a persistent kernel software-pipelined over rounds would
use).

µs per round = (time at ``--rounds`` rounds - time at one round) / (``--rounds`` - 1), launches timed back to back
with CUDA events (median of ``--reps``); the copy's bandwidth counts its loads and stores.

    python bench/probes/probe_grid_barrier.py --ctas 128 132 --vectors 0 13 --barriers 0 1 2 --lags 1 2
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from mhc_cute.kernels import compile_kernel, fake_buffer  # noqa: E402  (first: sets the DSL's target arch)
from mhc_cute.kernels import device_utils as du  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16, Int32  # noqa: E402

BARRIER_KINDS = ("atomic", "red")


class GridBarrierProbe:
    def __init__(self, ctas: int, threads: int, vectors: int, barriers: int, kind: str, lag: int = 0):
        assert kind in BARRIER_KINDS and (lag == 0 or barriers == 1)
        self.ctas, self.threads, self.vectors, self.barriers, self.kind = ctas, threads, vectors, barriers, kind
        self.lag = lag

    @cute.jit
    def __call__(self, mCounter: cute.Tensor, mSrc: cute.Tensor, mDst: cute.Tensor, rounds: Int32, stream):
        self.kernel(mCounter, mSrc, mDst, rounds).launch(grid=[self.ctas, 1, 1], block=[self.threads + du.WARP, 1, 1],
                                                         stream=stream, cooperative=True)

    @cute.jit
    def vector(self, buf: cute.Tensor, r, v):
        """This copying thread's 16-byte vector ``v`` of round ``r`` in ``buf`` (consecutive threads, consecutive
        vectors)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = ((r * self.ctas + bidx) * self.vectors + v) * self.threads + tidx - du.WARP
        return cute.local_tile(buf, (du.VEC_BF16,), (i,))

    @cute.jit
    def load_round(self, mSrc: cute.Tensor, r, regs: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx >= du.WARP:
            for v in cutlass.range_constexpr(self.vectors):
                cute.autovec_copy(self.vector(mSrc, r, v), regs[v, None])

    @cute.jit
    def arrived(self, mCounter: cute.Tensor) -> Int32:
        """The counter, read with acquire semantics (an atomic add of 0, or an acquire load)."""
        if cutlass.const_expr(self.kind == "atomic"):
            return cute.arch.atomic_add(mCounter.iterator, Int32(0), sem="acquire", scope="gpu")
        return cute.arch.load(mCounter.iterator, Int32, sem="acquire", scope="gpu")

    @cute.jit
    def arrive(self, mCounter: cute.Tensor):
        """One thread announces the CTA's arrival (release: the CTA's stores before it, given a CTA barrier)."""
        if cutlass.const_expr(self.kind == "atomic"):
            cute.arch.fence_acq_rel_gpu()
            cute.arch.atomic_add(mCounter.iterator, Int32(1), sem="release", scope="gpu")
        else:
            cute.arch.red(mCounter.iterator, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")

    @cute.jit
    def grid_barrier(self, mCounter: cute.Tensor, k):
        tidx, _, _ = cute.arch.thread_idx()
        cute.arch.sync_threads()
        if tidx == 0:
            self.arrive(mCounter)
            seen = self.arrived(mCounter)
            while seen < (k + 1) * self.ctas:
                seen = self.arrived(mCounter)
        cute.arch.sync_threads()

    @cute.jit
    def split_barrier(self, mCounter: cute.Tensor, r, seen: Int32):
        """Round ``r``'s end with a split-phase barrier: wait until every CTA has arrived at the barrier of round
        ``r - lag`` (``seen``: the counter as read at the start of this round, usually enough), then arrive at
        round ``r``'s after the CTA barrier, so that only the barrier thread waits for the release."""
        tidx, _, _ = cute.arch.thread_idx()
        cute.arch.sync_threads()
        if tidx == 0:
            while seen < (r - self.lag + 1) * self.ctas:
                seen = self.arrived(mCounter)
        cute.arch.sync_threads()
        if tidx == 0:
            self.arrive(mCounter)

    @cute.kernel
    def kernel(self, mCounter: cute.Tensor, mSrc: cute.Tensor, mDst: cute.Tensor, rounds: Int32):
        regs = cute.make_rmem_tensor(du.row_major(max(self.vectors, 1), du.VEC_BF16), BFloat16)
        self.load_round(mSrc, 0, regs)
        tidx, _, _ = cute.arch.thread_idx()
        for r in cutlass.range(rounds, unroll=1):
            seen = Int32(0)
            if cutlass.const_expr(self.lag > 0):
                if tidx == 0:
                    seen = self.arrived(mCounter)  # read early: its round trip overlaps the copy's issue
            if tidx >= du.WARP:
                for v in cutlass.range_constexpr(self.vectors):
                    cute.autovec_copy(regs[v, None], self.vector(mDst, r, v))
            # the next round's loads are in flight through this round's barriers (clamped: the last round
            # reloads its own vectors)
            self.load_round(mSrc, cutlass.min(r + 1, rounds - 1), regs)
            if cutlass.const_expr(self.lag > 0):
                self.split_barrier(mCounter, r, seen)
            else:
                for b in cutlass.range_constexpr(self.barriers):
                    self.grid_barrier(mCounter, r * self.barriers + b)


def compiled(ctas: int, threads: int, vectors: int, barriers: int, kind: str, lag: int = 0):
    return compile_kernel(GridBarrierProbe(ctas, threads, vectors, barriers, kind, lag), fake_buffer(Int32),
                          fake_buffer(BFloat16), fake_buffer(BFloat16), Int32(0))


def launch_us(fn, counter, src, dst, rounds: int, reps: int, expected: int) -> float:
    """Median µs per launch of ``rounds`` rounds, each launch after zeroing the counter."""
    times = []
    for _ in range(reps):
        counter.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(counter, src, dst, rounds)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    assert counter[0].item() == expected, "the barriers did not all complete"
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", type=int, nargs="+", default=[128, 132])
    ap.add_argument("--threads", type=int, default=256, help="copying threads per CTA (plus one barrier warp)")
    ap.add_argument("--vectors", type=int, nargs="+", default=[0, 13], help="16-byte vectors per thread per round")
    ap.add_argument("--barriers", type=int, nargs="+", default=[0, 1, 2], help="grid barriers per round")
    ap.add_argument("--kinds", nargs="+", choices=BARRIER_KINDS, default=list(BARRIER_KINDS))
    ap.add_argument("--lags", type=int, nargs="*", default=[],
                    help="also one split-phase barrier per round whose wait comes this many rounds after its arrival")
    ap.add_argument("--rounds", type=int, default=65)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda")
    counter = torch.zeros(4, dtype=torch.int32, device=dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}")
    for ctas in args.ctas:
        for vectors in args.vectors:
            n = args.rounds * ctas * max(vectors, 1) * args.threads * du.VEC_BF16
            src = torch.randn(n, device=dev).to(torch.bfloat16)
            dst = torch.empty_like(src)
            round_bytes = 2 * ctas * vectors * args.threads * 16  # loads and stores of one round
            configs = [(b, 0) for b in args.barriers] + [(1, lag) for lag in args.lags]
            for kind in args.kinds:
                for barriers, lag in configs:
                    if barriers == 0 and (vectors == 0 or kind != args.kinds[0]):
                        continue  # nothing to time, or the same kernel as the first kind's
                    fn = compiled(ctas, args.threads, vectors, barriers, kind, lag)
                    launch_us(fn, counter, src, dst, 1, 3, barriers * ctas)  # warm-up
                    one = launch_us(fn, counter, src, dst, 1, args.reps, barriers * ctas)
                    many = launch_us(fn, counter, src, dst, args.rounds, args.reps, args.rounds * barriers * ctas)
                    per = (many - one) / (args.rounds - 1)
                    if vectors:
                        assert torch.equal(dst, src), "the copy is wrong"
                    bw = f"  copy {round_bytes / per / 1e6:6.2f} TB/s" if vectors else ""
                    how = f"{kind} split, lag {lag}" if lag else (kind if barriers else "-")
                    print(f"ctas={ctas:4d} vectors={vectors:3d} barriers={barriers} {how:18s} "
                          f"{per:7.3f} us per round{bw}", flush=True)
            del src, dst
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
