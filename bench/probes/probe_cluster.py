"""Can the on-chip-collapse design (docs/experiments.md: a thread-block cluster of S CTAs splits each token's H, reduces
the partials through distributed shared memory and collapses `residual_cur` from shared memory) run on this GPU? Two of
its open questions:

1. How many clusters of S CTAs, each holding ``--smem-kb`` of shared memory (the design's ~215 KB: one CTA per
   SM), are resident at once? Every CTA records its SM and its start and end (``%globaltimer``); the host counts
   the most clusters running at one time and the SMs they cover.
2. What does a tile's cluster tail cost? Per round: every CTA writes T partial rows of 32 fp32 (the 24 dots, the
   sum of squares) to its shared memory; cluster barrier; CTA r sums, in rank order, the rows of its T / S tokens
   over the S CTAs through distributed shared memory (``ld.shared::cluster``), derives four gates per token (a
   sigmoid each) and writes them into every CTA's shared memory (``st.shared::cluster``); cluster barrier; each
   thread reads one gate, which enters its partials of the next round (so each round waits for the last). µs per
   round = (t(rounds) - t(1)) / (rounds - 1), launches timed with CUDA events (median of ``--reps``). The last
   round's gates are checked against the same arithmetic in float64 on the host.

The Sinkhorn of the T / S tokens per CTA is not in it (about 1.2-1.7 µs on one lane per token, measured in the
big fuse: `bench/probes/probe_sinkhorn.py`), nor any memory traffic beside it.

    python bench/probes/probe_cluster.py --cluster 8 16 --tokens 16 24 32
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute.kernels import compile_kernel, fake_buffer  # noqa: E402  (first: sets the DSL's target arch)
from mhc_cute.kernels import device_utils as du  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import AddressSpace, Float32, Int32  # noqa: E402
from cutlass._mlir.dialects import llvm, nvvm  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402

ROW = 32  # floats per partial row (24 dots, the sum of squares, padding)
GATES = 4
STAMPS = 3  # per CTA: SM, start, end (globaltimer, low 32 bits)


@dsl_user_op
def _peer_address(smem_ptr, rank, *, loc=None, ip=None):
    """``smem_ptr`` in the shared memory of the cluster's CTA ``rank`` (``mapa``; ld/st.shared::cluster on it)."""
    return nvvm.mapa(llvm.PointerType.get(AddressSpace.dsmem), smem_ptr.to_llvm_ptr(loc=loc, ip=ip),
                     Int32(rank).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)


@dsl_user_op
def load_peer(smem_ptr, rank, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.load(T.f32(), _peer_address(smem_ptr, rank, loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def store_peer(smem_ptr, rank, value: Float32, *, loc=None, ip=None) -> None:
    llvm.store(Float32(value).ir_value(loc=loc, ip=ip), _peer_address(smem_ptr, rank, loc=loc, ip=ip), loc=loc, ip=ip)


class ClusterTailProbe:
    def __init__(self, cluster: int, tokens: int, smem_kb: int, threads: int = 128):
        assert tokens % cluster == 0 and (tokens // cluster) * ROW <= threads
        self.cluster, self.tokens, self.threads = cluster, tokens, threads
        self.own = tokens // cluster  # tokens whose partial rows this CTA sums
        self.pad_bytes = max(0, smem_kb * 1024 - 4 * tokens * (ROW + GATES) - 64)

    @cute.jit
    def __call__(self, mStamps: cute.Tensor, mChecks: cute.Tensor, mPartials: cute.Tensor, rounds: Int32, stream):
        clusters = mStamps.shape[0] // (self.cluster * STAMPS)
        self.kernel(mStamps, mChecks, mPartials, rounds).launch(grid=[clusters * self.cluster, 1, 1],
                                                      block=[self.threads, 1, 1], cluster=[self.cluster, 1, 1],
                                                      stream=stream)

    @cute.kernel
    def kernel(self, mStamps: cute.Tensor, mChecks: cute.Tensor, mPartials: cute.Tensor, rounds: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rank = cute.arch.block_idx_in_cluster()
        smem = cutlass.memory.SmemAllocator()
        partials = smem.allocate_tensor(Float32, du.row_major(self.tokens, ROW), 16)
        gates = smem.allocate_tensor(Float32, du.row_major(self.tokens, GATES), 16)
        if cutlass.const_expr(self.pad_bytes > 0):
            smem.allocate_tensor(cutlass.Int8, du.row_major(self.pad_bytes), 16)  # occupancy: the design's residency
        start = cute.arch.globaltimer_lo()
        checksum = Float32(0.5)  # (the carried gate enters as (gate - 0.5) / 10)
        for r in cutlass.range(rounds, unroll=1):
            # this CTA's partial rows for the round (from a global row of seeds, so the host can redo the sums)
            for i in cutlass.range_constexpr(0, self.tokens * ROW, self.threads):
                if i + tidx < self.tokens * ROW:
                    partials[(i + tidx) // ROW, (i + tidx) % ROW] = (
                        mPartials[rank * ROW + (i + tidx) % ROW] * Float32(1.0 + (i + tidx) // ROW)
                        + (checksum - Float32(0.5)) * Float32(0.1))
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            # sum the own tokens' rows over the cluster, rank order; lane c of token group t: column c
            t, c = tidx // ROW, tidx % ROW
            if t < self.own:
                token = rank * self.own + t
                total = Float32(0.0)
                for peer in cutlass.range_constexpr(self.cluster):
                    total = total + load_peer(partials.iterator + (token * ROW + c), peer)
                if c < GATES:
                    gate = du.sigmoid(total)
                    for peer in cutlass.range_constexpr(self.cluster):
                        store_peer(gates.iterator + (token * GATES + c), peer, gate)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            # each thread carries one gate into its next partials: every round waits for the last one's gates
            g = tidx % (self.tokens * GATES)
            checksum = gates[g // GATES, g % GATES]
        end = cute.arch.globaltimer_lo()
        if tidx == 0:
            mStamps[bidx * STAMPS] = cute.arch.smid()
            mStamps[bidx * STAMPS + 1] = start
            mStamps[bidx * STAMPS + 2] = end
            mChecks[bidx] = checksum


def compiled(cluster: int, tokens: int, smem_kb: int):
    return compile_kernel(ClusterTailProbe(cluster, tokens, smem_kb), fake_buffer(Int32), fake_buffer(Float32),
                          fake_buffer(Float32), Int32(0))


def expected_gate(seeds, cluster: int, tokens: int, threads: int, rounds: int) -> float:
    """Thread 0's gate after ``rounds`` rounds (every cluster computes the same), in float64."""
    seeds = seeds.double().reshape(cluster, ROW)
    gates = torch.zeros(tokens * GATES, dtype=torch.float64)
    for r in range(rounds):
        carried = torch.full((threads,), 0.5, dtype=torch.float64) if r == 0 else gates[torch.arange(threads)
                                                                                            % gates.numel()]
        e = torch.arange(tokens * ROW)
        partials = seeds[:, e % ROW] * (1 + e // ROW).double() + (carried[e % threads] - 0.5) * 0.1
        totals = partials.sum(0).reshape(tokens, ROW)[:, :GATES]
        gates = torch.sigmoid(totals).reshape(-1)
    return gates[0].item()


def resident_clusters(stamps, cluster: int) -> tuple[int, int]:
    """The most clusters running at one time (each from its first CTA's start to its last CTA's end) and the SMs
    that ran CTAs."""
    st = stamps.view(-1, STAMPS).long()
    ref = int(st[:, 1].min())
    start = ((st[:, 1] - ref) % 2**32).view(-1, cluster).min(1).values
    end = ((st[:, 2] - ref) % 2**32).view(-1, cluster).max(1).values
    events = sorted([(int(t), 1) for t in start] + [(int(t), -1) for t in end])
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most, len(set(st[:, 0].tolist()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 24, 32])
    ap.add_argument("--smem-kb", type=int, nargs="+", default=[215, 100])
    ap.add_argument("--rounds", type=int, default=201)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"GPU: {torch.cuda.get_device_name(dev)}, {sms} SMs")
    for cluster in args.cluster:
        seeds = 0.05 * torch.randn(cluster * ROW, device=dev)
        for smem_kb in args.smem_kb:
            for tokens in args.tokens:
                if tokens % cluster or (tokens // cluster) * ROW > 128:
                    continue
                try:
                    fn = compiled(cluster, tokens, smem_kb)
                except Exception as e:  # a size the DSL refuses: say so, go on
                    print(f"S={cluster:2d} T={tokens:2d} smem={smem_kb}KB: does not compile ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]})", flush=True)
                    continue
                # residency: two waves' worth of clusters, long enough to overlap
                waves = 2 * -(-sms // cluster)
                stamps = torch.zeros(waves * cluster * STAMPS, dtype=torch.int32, device=dev)
                checks = torch.full((waves * cluster,), float("nan"), device=dev)
                try:
                    fn(stamps, checks, seeds, 2000)
                    torch.cuda.synchronize()
                except Exception as e:
                    print(f"S={cluster:2d} T={tokens:2d} smem={smem_kb}KB: launch failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]})", flush=True)
                    continue
                most, used = resident_clusters(stamps.cpu(), cluster)
                want = expected_gate(seeds.cpu(), cluster, tokens, 128, 2000)
                bad = int((~torch.isclose(checks.double().cpu(), torch.tensor(want, dtype=torch.float64),
                                          rtol=1e-3)).sum())
                # the tail per round, with as many clusters as were resident at once
                stamps = torch.zeros(most * cluster * STAMPS, dtype=torch.int32, device=dev)
                checks = torch.empty(most * cluster, device=dev)
                times = {rounds: statistics.median(mb.launch_us(
                    lambda: fn(stamps, checks, seeds, rounds), args.reps))
                    for rounds in (1, args.rounds)}
                per = (times[args.rounds] - times[1]) / (args.rounds - 1)
                print(f"S={cluster:2d} T={tokens:2d} smem={smem_kb}KB: {most:3d} clusters resident at once "
                      f"({most * cluster} CTAs; {used} SMs ran CTAs); {per:6.3f} us per round; gates "
                      f"{'ok' if bad == 0 else f'WRONG in {bad} CTAs'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
