"""Does a CTA's release arrival make the global stores of *all* its warps visible to another CTA that acquires it?
The question behind the persistent kernel's wrong results (docs/experiments.md): its MMA warpgroup stores partial rows
from four warps, then one thread (after a barrier of the four), or a separate warp, announces them on a counter that
other CTAs poll.

A cooperative launch of ``--ctas`` CTAs runs ``--rounds`` rounds. In each, the 128 writer threads of a CTA copy
``--bulk`` 16-byte vectors each (loads and stores: the memory traffic a streaming kernel has in flight), then store
one 32-bit payload word each into slot ``r % 3`` of a payload ring, and publish them (``--modes``):

* ``one``: a barrier of the writers, then one thread's release reduction on the slot's counter;
* ``fenced``: each writer fences its own stores (``fence.acq_rel.gpu``), then as ``one``;
* ``signal``: each writer arrives on a shared-memory barrier; a separate warp waits on it and makes the release;
* ``warps``: each writer warp's first lane makes its own release after a warp barrier (four arrivals per CTA).

A reader warp per CTA waits (acquire polls) until every CTA has published the round, reads the payload of the next
CTA and counts the words that are not this round's; then it announces that it has read the slot (writers reuse a
slot three rounds later only after every reader is done with it, the persistent kernel's ring discipline).

    python bench/probes/probe_publish.py --ctas 128 --rounds 512 --bulk 0 8 --modes one fenced signal warps
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
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass import BFloat16, Int32  # noqa: E402

MODES = ("one", "fenced", "signal", "warps")
SLOTS = 3
WRITERS = 128
READER_WARP = WRITERS // du.WARP
SIGNAL_WARP = READER_WARP + 1
THREADS = (SIGNAL_WARP + 1) * du.WARP
WRITTEN, READ, ERRORS = 0, SLOTS, 2 * SLOTS  # counters: per slot written / read arrivals, then the error count
WRITER_BARRIER = 1


class PublishProbe:
    def __init__(self, ctas: int, bulk: int, mode: str):
        assert mode in MODES
        self.ctas, self.bulk, self.mode = ctas, bulk, mode
        self.arrivals = ctas * (WRITERS // du.WARP if mode == "warps" else 1)  # per round

    @cute.jit
    def __call__(self, mCounters: cute.Tensor, mPayload: cute.Tensor, mSrc: cute.Tensor, mDst: cute.Tensor,
                 rounds: Int32, stream):

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * 2]

        self.shared_storage = SharedStorage
        self.kernel(mCounters, mPayload, mSrc, mDst, rounds).launch(
            grid=[self.ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, cooperative=True)

    @cute.jit
    def wait(self, mCounters: cute.Tensor, which: int, r, per_round):
        """Every thread polls (acquire) until the slot of round ``r`` has all of round ``r``'s arrivals."""
        ptr = mCounters.iterator + which + r % SLOTS
        target = (r // SLOTS + 1) * per_round
        seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
        while seen < target:
            seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")

    @cute.jit
    def arrive(self, mCounters: cute.Tensor, which: int, r):
        cute.arch.red(mCounters.iterator + which + r % SLOTS, Int32(1), op="add", dtype=Int32, sem="release",
                      scope="gpu")

    @cute.kernel
    def kernel(self, mCounters: cute.Tensor, mPayload: cute.Tensor, mSrc: cute.Tensor, mDst: cute.Tensor,
               rounds: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        signal = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=2,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WRITERS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, du.WARP),
        )
        if warp < READER_WARP:
            regs = cute.make_rmem_tensor(du.row_major(max(self.bulk, 1), du.VEC_BF16), BFloat16)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
            for r in cutlass.range(rounds, unroll=1):
                if r >= SLOTS:
                    self.wait(mCounters, READ, r - SLOTS, self.ctas)  # the readers are done with the slot
                for v in cutlass.range_constexpr(self.bulk):
                    i = ((r * self.ctas + cta) * self.bulk + v) * WRITERS + tidx
                    cute.autovec_copy(cute.local_tile(mSrc, (du.VEC_BF16,), (i,)), regs[v, None])
                for v in cutlass.range_constexpr(self.bulk):
                    i = ((r * self.ctas + cta) * self.bulk + v) * WRITERS + tidx
                    cute.autovec_copy(regs[v, None], cute.local_tile(mDst, (du.VEC_BF16,), (i,)))
                mPayload[r % SLOTS, cta, tidx] = r * WRITERS + tidx
                if cutlass.const_expr(self.mode == "signal"):
                    signal.producer_acquire(state)
                    signal.producer_commit(state)
                    state.advance()
                elif cutlass.const_expr(self.mode == "warps"):
                    cute.arch.sync_warp()
                    if lane == 0:
                        self.arrive(mCounters, WRITTEN, r)
                else:
                    if cutlass.const_expr(self.mode == "fenced"):
                        cute.arch.fence_acq_rel_gpu()
                    cute.arch.barrier(barrier_id=WRITER_BARRIER, number_of_threads=WRITERS)
                    if tidx == 0:
                        self.arrive(mCounters, WRITTEN, r)
        elif warp == READER_WARP:
            errors = Int32(0)
            src = (cta + 1) % self.ctas
            for r in cutlass.range(rounds, unroll=1):
                self.wait(mCounters, WRITTEN, r, self.arrivals)
                for k in cutlass.range_constexpr(WRITERS // du.WARP):
                    t = lane + k * du.WARP
                    errors = errors + Int32(mPayload[r % SLOTS, src, t] != r * WRITERS + t)
                cute.arch.sync_warp()
                if lane == 0:
                    self.arrive(mCounters, READ, r)
            if errors > 0:
                cute.arch.atomic_add(mCounters.iterator + ERRORS, errors, sem="relaxed", scope="gpu")
        elif cutlass.const_expr(self.mode == "signal"):
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
            for r in cutlass.range(rounds, unroll=1):
                signal.consumer_wait(state)
                if lane == 0:
                    self.arrive(mCounters, WRITTEN, r)
                cute.arch.sync_warp()
                signal.consumer_release(state)
                state.advance()


def compiled(ctas: int, bulk: int, mode: str):
    return compile_kernel(PublishProbe(ctas, bulk, mode), fake_buffer(Int32), fake_int32_ring(ctas),
                          fake_buffer(BFloat16), fake_buffer(BFloat16), Int32(0))


def fake_int32_ring(ctas: int):
    """The payload ring ``[SLOTS, ctas, WRITERS]`` int32."""
    return cute.runtime.make_fake_tensor(Int32, (SLOTS, ctas, WRITERS), (ctas * WRITERS, WRITERS, 1), assumed_align=16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=512)
    ap.add_argument("--bulk", type=int, nargs="+", default=[0, 8], help="16-byte vectors copied per writer per round")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--launches", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(dev)}")
    counters = torch.zeros(2 * SLOTS + 1, dtype=torch.int32, device=dev)
    payload = torch.zeros(SLOTS, args.ctas, WRITERS, dtype=torch.int32, device=dev)
    for bulk in args.bulk:
        n = args.rounds * args.ctas * max(bulk, 1) * WRITERS * du.VEC_BF16
        src = torch.randn(n, device=dev).to(torch.bfloat16)
        dst = torch.empty_like(src)
        for mode in args.modes:
            fn = compiled(args.ctas, bulk, mode)
            errors, times = 0, []
            for _ in range(args.launches):
                counters.zero_()
                payload.fill_(-1)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn(counters, payload, src, dst, args.rounds)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / args.rounds)
                errors += int(counters[ERRORS].item())
            words = args.launches * args.rounds * args.ctas * WRITERS
            print(f"ctas={args.ctas} bulk={bulk:2d} {mode:7s} stale words {errors:9d} of {words} "
                  f"({errors / words:.2e})  {statistics.median(times):6.3f} us per round", flush=True)
        del src, dst
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
