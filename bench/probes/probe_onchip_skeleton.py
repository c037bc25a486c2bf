"""The data movement of the on-chip-collapse design (docs/experiments.md) without its projection: how close to the copy
bandwidth do clusters of S CTAs stream the op's 20 H bytes per token when each tile of T tokens waits for a cluster tail
before its collapse? An upper bound for that design, as the MMA warpgroup alone was for the grid-persistent design
(docs/experiments.md, 2026-12-01).

Persistent clusters (``--clusters`` of them, all resident) walk the tiles c, c + clusters, ... CTA r of a cluster owns H
/ S positions of the tile's T tokens, a thread P octets (token, 8 positions). Per tile: the octets' 16-byte loads (4
`residual_prev` streams and `x_prev`) were issued during the previous tile; post-map (per stream j ``x post_j + sum_k
comb_kj rp_k`` with fixed coefficients, SPEC's chain), `residual_cur` rounded to bf16, stored to global and to shared
memory; the next tile's loads are issued; the cluster tail of `bench/probes/probe_cluster.py` (partial rows to shared
memory, cluster barrier, DSMEM sums of the CTA's T / S tokens over the cluster, four sigmoids per token broadcast to
every CTA, cluster barrier); the collapse, ``layer_input = sum_j gate_j residual_cur_j`` from shared memory, stored.
Outputs are checked against float64. Three ways to sync (``SYNCS``): "none" (no tail, constant gates: the copy alone);
"all" (every thread runs the tail's steps and arrives at the cluster barriers with release semantics: in the SASS a
`MEMBAR.ALL.GPU` per arrival, which waits for the thread's memory operations in flight, the next tile's loads included);
"warp" (a warp of its own runs the tail and arrives with release; the loading threads arrive relaxed, so their loads
stay in flight); "async" (no cluster barrier per tile: the loading threads push the tile's partial rows into the owning
CTAs' shared memory with ``st.async``, counted by the owner's mbarrier; a tail warp per CTA waits for its tokens' rows,
sums them and pushes the gates back the same way; the collapse of tile r runs after the post-map of tile r + 1, from the
second of two `residual_cur` buffers, so the gates have a whole tile's time to arrive); "project" (the "async" handoffs
with the design's projection instead of synthetic partials: the loading warps multiply the tile's `residual_cur` in
shared memory by the CTA's K slice of an fp32 weight ``fn [24, 4 H]`` read from L2 every tile, on the tensor cores
(m16n8k8 TF32, the weight split into hi + lo in registers as path E's warp MMA does; T = 16 tokens fill the 16 rows),
sum their warps' partial rows in shared memory in a fixed order and push them with the sums of squares; the tail warp
takes the pre gates as ``sigmoid(dot_j * rsqrt(sumsq / 4H + eps))``, a stand-in for SPEC's steps 2-4 without the
Sinkhorn). ``--collapse-from global`` has the collapse read `residual_cur` back from global memory (what the post-map
stored, from L2 if it is still there) instead of from the tile's copy in shared memory, by the loaders a tile behind or
(``--collapse-warps``, "async") by warps of their own.

    python bench/probes/probe_onchip_skeleton.py --cluster 8 16 --tokens 8 16 --hidden 7168 --m 8192
"""

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute.weights import bf16_terms  # noqa: E402
from mhc_cute.kernels import compile_kernel, fake_buffer  # noqa: E402  (first: sets the DSL's target arch)
from mhc_cute.kernels import device_utils as du  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16, Float32, Int32, TFloat32  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_cluster import GATES, ROW, load_peer, store_peer  # noqa: E402

STREAMS = 4
VEC = du.VEC_BF16
SYNCS = ("none", "all", "warp", "async", "project")
HANDOFFS = ("async", "project")  # the modes with mbarrier handoffs and the collapse a tile behind
SLOTS = 2  # tiles in flight per buffer kind with "async" by default (``slots``): the collapse ``slots - 1`` behind
MIXES = 24  # projection columns (SPEC: 4 pre, 4 post, 16 comb); the partial row's column MIXES is the sum of squares
MMA_N = 8  # columns per m16n8k8 TF32 tile: three cover the mixes
K_BLOCK = 4 * VEC  # K positions per warp-MMA block: four k8 steps, one octet of residual_cur per quad lane
RMS_EPS = 1e-6
SPLITS = ("round", "trunc")  # the weight's TF32 hi + lo: both rounded to nearest, or hi truncated and lo raw
# where the projection's weight blocks in flight wait: registers, or shared memory (each lane's own pieces through
# cp.async); "bulk" (MMA warps only): a ring of whole blocks per MMA warp in shared memory, each filled by one bulk
# copy (cp.async.bulk, counted by the stage's mbarrier) from a copy of the weight laid out block by block, in the
# order the lanes read it; "synthetic" (timing only, its outputs are not the op's) makes the weights up in
# registers from the lane and block index, with no loads at all
# "wgmma" (one or two warpgroups of MMA warps): the projection as warpgroup MMAs from shared memory, the weight's
# bf16 terms as A, the tile's residual_cur as B (its tokens as N, K-major: the post-map stores it in that layout), A
# brought in by bulk copies of a prepared copy (``wgmma_weight``), ``WG_GROUP`` MMAs (128 K positions) per ring
# stage: one copy, one full and one empty mbarrier. ``terms`` 2: hi + lo (16 of fp32's 24 mantissa bits), rows 0-47
# of one m64 MMA; 3: hi + mid + lo (all 24), a second m64 MMA per step for lo (``weight_row``)
RINGS = ("registers", "cp.async", "bulk", "synthetic", "wgmma")
COLLAPSE_FROM = ("shared", "global")
BLOCK_FLOATS = MIXES * K_BLOCK  # one block's weights: 24 rows x 32 K positions
WG_K = 16  # K positions per bf16 warpgroup MMA
WG_ROWS = 64  # its M: the weight's bf16 terms, 24 rows each (``wgmma_weight``)
WG_GROUP = 8  # MMAs accumulated in the tensor cores before an fp32 add (Hopper's accumulator is not a full fp32 adder)
WG_SET = WG_ROWS * WG_GROUP * WG_K  # bf16 elements of a group's A tiles for one m64 MMA per step (64 x 128)
WG_ROW_GROUP = 8 * WG_GROUP * WG_K  # of their 8-row slab (the group layout is K first: a slab is contiguous)
TAIL_REGS = 64  # setmaxnreg of the tail warp's warpgroup when it has one of its own (the tail warp and idle warps)


def post_coef(j: int) -> float:
    return 0.5 + 0.125 * j


def comb_coef(k: int, j: int) -> float:
    return 0.25 + 0.0625 * (k - j)


def partial_value(m, c, rank):
    """The synthetic partial of token ``m``, column ``c`` from cluster rank ``rank`` (host: integers or tensors)."""
    return ((m * 7 + c * 3 + rank) % 17) * (1.0 / 17) - 0.5


@cute.jit
def device_partial(m, c, rank) -> Float32:
    """``partial_value`` on the device (fp32; every value is exact or one rounding of k / 17 - 0.5)."""
    return Float32((m * 7 + c * 3 + rank) % 17) * Float32(1.0 / 17) - Float32(0.5)


class OnchipSkeleton:
    def __init__(self, cluster: int, tokens: int, hidden: int, clusters: int, sync: str, threads: int = 224,
                 lookahead: int = 1, carry: bool = False, split: str = "round", mma_warps: int = 0,
                 mma_regs: int = 152, ring: str = "registers", chains: int = 1, unroll: int = 1, terms: int = 2,
                 kmajor: bool = False, slots: int = SLOTS, reserve: int = 0, free_weights: bool = False,
                 tokens_m: bool = False, collapse_from: str = "shared", collapse_warps: int = 0,
                 collapse_regs: int = 112):
        assert sync in SYNCS and split in SPLITS and ring in RINGS and (mma_warps == 0 or sync == "project")
        assert ring != "bulk" or mma_warps, "the bulk ring feeds MMA warps of their own"
        assert ring != "wgmma" or (mma_warps in (4, 8) and lookahead >= 2 and lookahead & (lookahead - 1) == 0), \
            "wgmma: one or two warpgroups of MMA warps, a ring of two or more stages each, a power of two"
        # the projection's weight loads ("project"): ``lookahead`` blocks in flight per warp, in registers or in
        # shared memory (``ring``; each lane copies and reads back its own 16-byte pieces), with ``carry`` the next
        # tile's first blocks fetched at the end of this tile's projection (the weights are the same every tile)
        self.lookahead, self.carry, self.split, self.ring = lookahead, carry, split, ring
        self.slots = slots
        # KB of shared memory allocated and never used ("async" and "project"): what the L1 cache left beside a
        # kernel's shared memory does to its loads, timed alone
        self.reserve = reserve
        # "wgmma", timing only: the ring's stages never copied (each full mbarrier arrived on at once; the MMAs read
        # whatever the stages hold): the design without the weight's L2 traffic and latency
        self.free_weights = free_weights
        assert not free_weights or ring == "wgmma"
        # "wgmma" with the tile's tokens as the MMAs' M (A = residual_cur, its rows past the tile's tokens unread) and
        # every term of every column as N (B = the weight's stage, 24 terms rows): one m64n48 or m64n72 MMA per 16 K
        # positions, each thread holding all terms of its columns
        self.tokens_m = tokens_m
        assert not tokens_m or ring == "wgmma"
        # where the collapse reads residual_cur: the tile's copy in shared memory, or (``COLLAPSE_FROM`` "global")
        # what the post-map stored to global memory a tile earlier (from L2, if it is still there); then only the
        # projection keeps a copy in shared memory ("async" allocates none)
        assert collapse_from in COLLAPSE_FROM
        self.collapse_from = collapse_from
        self.keeps_rc = collapse_from == "shared" or sync == "project"
        # "async" with the collapse from global memory: warps of their own collapse each tile once its gates are in
        # (``collapse_regs`` registers each), so that the loaders' loop never waits for the re-read (0: the loaders
        # collapse, a tile behind their post-map)
        self.collapse_warps, self.collapse_regs = collapse_warps, collapse_regs
        assert not collapse_warps or (sync == "async" and collapse_from == "global" and collapse_warps % 4 == 0
                                      and threads % 128 in (0, 128 - du.WARP)
                                      and tokens * (hidden // cluster // VEC) % (du.WARP * collapse_warps) == 0), \
            "whole warpgroups per role, the tile's octets split evenly over the collapse warps"
        assert slots in (2, 3) and (slots == 2 or sync in HANDOFFS)
        self.chains = chains  # independent MMA accumulators per column tile (1, 2 or 4)
        self.unroll = unroll  # "bulk": blocks per iteration of the projection's loop
        self.terms = terms  # "wgmma": bf16 terms of the weight (2: hi + lo, 3: hi + mid + lo)
        # residual_cur in shared memory K-major, with the lanes' octets to match (``rc_row``, ``octet``): what
        # "wgmma" reads as its B; any mode can take it, to time the layout alone
        self.kmajor = kmajor or ring == "wgmma"
        assert not self.kmajor or (hidden // cluster // VEC % 8 == 0 and tokens % 8 == 0), "whole swizzled rows"
        assert terms in (2, 3)
        assert chains in (1, 2, 4)
        # "project": 0, the loading warps project; else warps of their own do, after the tail warp, in warpgroups
        # of their own with fewer registers (``setmaxnreg``: the loading warps need more than an even share)
        self.mma_warps, self.threads = mma_warps, threads  # threads: load, post-map and collapse (+ tail warp)
        # the first MMA thread: warpgroups of their own, so after the tail warp's, which idle warps fill up when the
        # loaders are whole warpgroups themselves (256 threads, for H = 4096's tiles)
        self.mma_first = (threads + du.WARP + 127) // 128 * 128 if mma_warps else threads + du.WARP
        # collapse warps: warpgroups of their own after the loaders' and the tail warp's (idle warps fill the tail
        # warp's warpgroup when the loaders are whole warpgroups themselves, as for MMA warps)
        self.collapse_first = (threads + du.WARP + 127) // 128 * 128
        self.block_threads = (self.mma_first + du.WARP * mma_warps if mma_warps
                              else self.collapse_first + du.WARP * collapse_warps if collapse_warps
                              else threads + (du.WARP if sync not in ("none", "all") else 0))
        if collapse_warps:
            rest = self.even_registers() * self.block_threads - collapse_regs * du.WARP * collapse_warps
            if self.collapse_first == threads + du.WARP:
                self.loader_regs = self.tail_regs = min(240, rest // (threads + du.WARP) // 8 * 8)
            else:
                self.tail_regs = TAIL_REGS
                self.loader_regs = min(240, (rest - TAIL_REGS * 128) // threads // 8 * 8)
        if mma_warps:
            assert threads % 128 in (0, 128 - du.WARP) and mma_warps % 4 == 0, "whole warpgroups per role"
            self.mma_regs = mma_regs
            # setmaxnreg moves registers within what the launch gave the CTA (its even share per thread, in
            # eights): asking for more in all than that blocks the increasing warps for good (a hang, not an error)
            pool = self.even_registers() * self.block_threads
            rest = pool - self.mma_regs * du.WARP * mma_warps
            if self.mma_first == threads + du.WARP:  # the tail warp in the loaders' last warpgroup
                self.loader_regs = self.tail_regs = rest // (threads + du.WARP) // 8 * 8
            else:  # the tail warp's warpgroup (three idle warps) at TAIL_REGS
                self.tail_regs = TAIL_REGS
                self.loader_regs = (rest - TAIL_REGS * 128) // threads // 8 * 8
        self.cluster, self.tokens, self.hidden, self.clusters, self.sync = cluster, tokens, hidden, clusters, sync
        self.octets = hidden // cluster // VEC  # per token, in this CTA's slice
        assert hidden % (cluster * VEC) == 0 and tokens % cluster == 0 and (tokens // cluster) * ROW <= threads
        assert (tokens * self.octets) % threads == 0, "octets per tile must split evenly over the threads"
        self.per_thread = tokens * self.octets // threads
        self.own = tokens // cluster
        self.warps = threads // du.WARP
        if sync == "project":
            blocks = STREAMS * self.octets * VEC // K_BLOCK
            self.proj_warps = mma_warps or self.warps
            if ring == "wgmma":
                assert tokens in (16, 32), "the MMAs' N"
            else:
                assert tokens == 16 and self.octets % 4 == 0 and blocks % self.proj_warps == 0, "one m16 tile, blocks"
            self.blocks, self.blocks_per_warp = blocks, blocks // self.proj_warps
            self.k_steps = STREAMS * self.octets * VEC // WG_K  # wgmma: the CTA's K slice in MMAs
            self.groups = self.k_steps // WG_GROUP  # wgmma: ring stages per tile
            # wgmma: warpgroups of MMA warps, each with a ring of its own for groups w, w + wgs, ... of a tile
            self.wgs = max(1, mma_warps // 4)
            assert ring != "wgmma" or self.k_steps % (self.wgs * WG_GROUP) == 0, "whole groups per warpgroup"
            self.wg_groups = self.groups // self.wgs
            assert not carry or ring in ("bulk", "wgmma") or self.blocks_per_warp % lookahead == 0, "ring lines up"
            smem = (slots * tokens * STREAMS * self.octets * VEC * 2 + slots * tokens * (ROW + GATES) * 4
                    + (self.proj_warps * tokens * ROW * 4 if ring != "wgmma" else 0)
                    + (self.proj_warps * lookahead * MIXES * du.WARP * 4 if ring in ("cp.async", "bulk") else 0)
                    + (self.wgs * lookahead * self.stage_elems() * 2
                       + (self.d_floats() + slots * self.octets // 8 * tokens) * 4
                       if ring == "wgmma" else 0))
            assert smem + reserve * 1024 <= 227 * 1024, f"{smem + reserve * 1024} bytes of shared memory"

    @cute.jit
    def __call__(self, mX: cute.Tensor, mRes: cute.Tensor, mRc: cute.Tensor, mLi: cute.Tensor, mFn: cute.Tensor,
                 stream):
        m = mX.shape[0] // self.hidden
        x = cute.make_tensor(mX.iterator, du.row_major(m, self.hidden))
        res = cute.make_tensor(mRes.iterator, du.row_major(m, STREAMS * self.hidden))
        rc = cute.make_tensor(mRc.iterator, du.row_major(m, STREAMS * self.hidden))
        li = cute.make_tensor(mLi.iterator, du.row_major(m, self.hidden))
        if cutlass.const_expr(self.ring == "wgmma"):  # the A stages (``wgmma_weight``: bf16 pairs as fp32 words)
            fn = cute.make_tensor(mFn.iterator, du.row_major(self.cluster * self.groups, self.stage_elems() // 2))
        elif cutlass.const_expr(self.ring == "bulk"):  # the weight block by block (``blocked_weight``)
            fn = cute.make_tensor(mFn.iterator, du.row_major(STREAMS * self.hidden * MIXES // BLOCK_FLOATS,
                                                             BLOCK_FLOATS))
        else:
            fn = cute.make_tensor(mFn.iterator, du.row_major(MIXES, STREAMS * self.hidden))
        # setmaxnreg needs the occupancy bound, or ptxas drops it (CUTE_NOTES); the other modes compile as measured
        bound = {"min_blocks_per_mp": 1} if self.mma_warps or self.collapse_warps else {}
        self.kernel(x, res, rc, li, fn).launch(grid=[self.clusters * self.cluster, 1, 1],
                                               block=[self.block_threads, 1, 1],
                                               cluster=[self.cluster, 1, 1], stream=stream, **bound)

    def mmas(self) -> int:
        """"wgmma": MMAs per 16 K positions (with the weight as M, three terms' 72 rows take two m64 ones)."""
        return 2 if self.terms == 3 and not self.tokens_m else 1

    def stage_elems(self) -> int:
        """"wgmma": bf16 elements of a ring stage, all of them brought by its bulk copy: the group's A tiles (K
        first, 8-row slabs of ``WG_ROW_GROUP``); rows whose products nobody reads need addresses, not data. Two
        terms: rows 0-47, rows 48-63 reading into the next stage (past the last one, into ``sD``, allocated right
        after the ring and at least as large); three terms: the second MMA's three slabs of lo rows first, its other
        rows reading into the first MMA's, whose rows 48-63 read on like two terms'."""
        return 6 * WG_ROW_GROUP if self.terms == 2 else WG_SET + WG_ROW_GROUP

    def mma_shape(self):
        """"wgmma": the MMAs' (M, N): the weight's 64 rows by the tile's tokens, or (``tokens_m``) 64 rows from the
        tokens by every term of every column."""
        return (WG_ROWS, MIXES * self.terms) if self.tokens_m else (WG_ROWS, self.tokens)

    def d_floats(self) -> int:
        """"wgmma": ``sD``'s floats: per warpgroup the second MMA's rows (three terms), then per slot the second
        warpgroup's sums for the first (``push_rows``); at least the 4 KB the ring's last stage reads past its end."""
        return self.wgs * WG_ROWS * self.tokens + self.slots * 128 * self.sums_per_thread()

    def sums_per_thread(self) -> int:
        """"wgmma": the partial-row entries an MMA thread adds up: its tokens' columns (weight as M: a quarter of
        the tokens, one column; tokens as M: two tokens, twelve columns)."""
        return 2 * MIXES // 4 if self.tokens_m else self.tokens // 4

    def rc_row(self, t, j, o):
        """The 16-byte row of token ``t``'s octet ``o`` of stream ``j`` in a tile's residual_cur in shared memory:
        token-major, or ``kmajor`` (the layout of "wgmma"'s B operand, K_SW128: per 64 K positions, the tile's
        tokens' 128-byte rows one after another, each row's octets swizzled by the token: octet e of row t at
        e ^ (t % 8))."""
        if self.kmajor:
            kb = j * self.octets + o
            return (kb // 8 * self.tokens + t) * 8 + ((kb % 8) ^ (t % 8))
        return (t * STREAMS + j) * self.octets + o

    def even_registers(self) -> int:
        """The launch's registers per thread: the register file over the block's threads, in eights."""
        return 65536 // self.block_threads // 8 * 8

    @cute.jit
    def set_registers(self, count: int):
        """``setmaxnreg`` from the launch's even share to ``count``."""
        even = self.even_registers()
        if cutlass.const_expr(count > even):
            cute.arch.setmaxregister_increase(count)
        elif cutlass.const_expr(count < even):
            cute.arch.setmaxregister_decrease(count)

    @cute.jit
    def cluster_barrier(self, releases):
        """Every thread of the cluster: arrive (with release semantics where ``releases``, else relaxed), wait."""
        if releases:
            cute.arch.cluster_arrive()
        else:
            cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

    @cute.jit
    def tail(self, tile, rank, partials: cute.Tensor, gates: cute.Tensor, first: Int32, step: int):
        """The cluster tail, by the threads ``first``, ``first + 1``, ... (``step`` of them): the synthetic partial
        rows of the tile, the DSMEM sums of this CTA's tokens, their gates into every CTA of the cluster."""
        tidx, _, _ = cute.arch.thread_idx()
        releases = tidx >= first
        for i in cutlass.range_constexpr(0, self.tokens * ROW, step):
            e = i + tidx - first
            if releases and e < self.tokens * ROW:
                t, c = e // ROW, e % ROW
                partials[t, c] = device_partial(tile * self.tokens + t, c, rank)
        self.cluster_barrier(releases)
        for i in cutlass.range_constexpr(0, self.own * GATES, step):
            e = i + tidx - first
            if releases and e < self.own * GATES:
                token, c = rank * self.own + e // GATES, e % GATES
                total = Float32(0.0)
                for peer in cutlass.range_constexpr(self.cluster):
                    total = total + load_peer(partials.iterator + (token * ROW + c), peer)
                gate = du.sigmoid(total)
                for peer in cutlass.range_constexpr(self.cluster):
                    store_peer(gates.iterator + (token * GATES + c), peer, gate)
        self.cluster_barrier(releases)

    @cute.jit
    def load_tile(self, raw: cute.Tensor, tile, rank, mX: cute.Tensor, mRes: cute.Tensor, loader):
        if cutlass.const_expr(self.sync != "none" and self.sync != "all"):
            if loader:
                self.load_octets(raw, tile, rank, mX, mRes)
        else:
            self.load_octets(raw, tile, rank, mX, mRes)

    @cute.jit
    def octet(self, p: int, tile, rank, collapsing: bool = False):
        """This thread's octet ``p`` of the tile (as a loader, or as a collapse warp's thread): its token in the tile,
        its octet in the CTA's slice, the token's row and the octet's 8-vector index in a stream row."""
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(collapsing):
            q = tidx - self.collapse_first + p * du.WARP * self.collapse_warps
        else:
            q = tidx + p * self.threads
        if cutlass.const_expr(self.kmajor):
            # eight lanes on eight adjacent octets of one token (128 bytes: one line in global memory, one swizzled
            # row in shared memory, no bank conflicts), a warp on four tokens: whole lines, where lane pairs on 32
            # bytes of each of 16 tokens made many small requests
            t, o = (q // 8) % self.tokens, q // (8 * self.tokens) * 8 + q % 8
        else:
            t, o = q // self.octets, q % self.octets
        return t, o, tile * self.tokens + t, rank * self.octets + o

    @cute.jit
    def load_octets(self, raw: cute.Tensor, tile, rank, mX: cute.Tensor, mRes: cute.Tensor):
        """The tile's loads of the thread's octets (4 residual_prev vectors and one x_prev vector each)."""
        for p in cutlass.range_constexpr(self.per_thread):
            _, _, m, vec = self.octet(p, tile, rank)
            cute.autovec_copy(cute.local_tile(mX[m, None], (VEC,), (vec,)), raw[p, 0, None])
            for k in cutlass.range_constexpr(STREAMS):
                cute.autovec_copy(cute.local_tile(mRes[m, None], (VEC,), (k * (self.hidden // VEC) + vec,)),
                                  raw[p, 1 + k, None])

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRes: cute.Tensor, mRc: cute.Tensor, mLi: cute.Tensor, mFn: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rank = cute.arch.block_idx_in_cluster()
        first = bidx // self.cluster  # the cluster's first tile; then every ``clusters``-th
        n_tiles = mX.shape[0] // self.tokens
        count = (n_tiles - first + self.clusters - 1) // self.clusters
        loader = tidx < self.threads  # (all threads but the tail warp of "warp", "async" and "project")
        raw = cute.make_rmem_tensor(du.row_major(self.per_thread, 1 + STREAMS, VEC), BFloat16)
        # tile indices clamped, not loads skipped: a conditional fill of the loop-carried registers put them on
        # the stack (the tail warp, whose release must not wait for loads, skips them all the same)
        self.load_tile(raw, cutlass.min(first, n_tiles - 1), rank, mX, mRes, loader)
        smem = cutlass.memory.SmemAllocator()
        if cutlass.const_expr(self.sync in HANDOFFS):
            self.run_async(smem, raw, rank, first, count, n_tiles, loader, mX, mRes, mRc, mLi, mFn)
        else:
            self.run_synced(smem, raw, rank, first, count, n_tiles, loader, mX, mRes, mRc, mLi)

    @cute.jit
    def run_synced(self, smem, raw: cute.Tensor, rank, first, count, n_tiles, loader, mX: cute.Tensor,
                   mRes: cute.Tensor, mRc: cute.Tensor, mLi: cute.Tensor):
        """Modes "none", "all", "warp": post-map, next loads, tail (cluster barriers), collapse, per tile."""
        sRc = smem.allocate_tensor(BFloat16, du.row_major(self.tokens * STREAMS * self.octets if self.keeps_rc else 1,
                                                          VEC), 16)
        partials = smem.allocate_tensor(Float32, du.row_major(self.tokens, ROW), 16)
        gates = smem.allocate_tensor(Float32, du.row_major(self.tokens, GATES), 16)
        for it in cutlass.range(count, unroll=1):
            tile = first + it * self.clusters
            if loader:
                self.post_map(raw, tile, rank, mRc, sRc)
            # the next tile's loads fly during the tail and the collapse
            self.load_tile(raw, cutlass.min(tile + self.clusters, n_tiles - 1), rank, mX, mRes, loader)
            if cutlass.const_expr(self.sync == "all"):
                self.tail(tile, rank, partials, gates, Int32(0), self.threads)
            elif cutlass.const_expr(self.sync == "warp"):
                self.tail(tile, rank, partials, gates, Int32(self.threads), du.WARP)
            if loader:
                self.collapse(tile, rank, sRc, mRc, gates, mLi)

    @cute.jit
    def run_async(self, smem, raw: cute.Tensor, rank, first, count, n_tiles, loader, mX: cute.Tensor,
                  mRes: cute.Tensor, mRc: cute.Tensor, mLi: cute.Tensor, mFn: cute.Tensor):
        """Modes "async" and "project": mbarrier handoffs between the CTAs of a cluster, the collapse one tile
        behind."""
        tidx, _, _ = cute.arch.thread_idx()
        rc_rows = self.tokens * STREAMS * self.octets
        # (1024-byte aligned with "wgmma": the MMAs read it through matrix descriptors)
        sRc = smem.allocate_tensor(BFloat16, du.row_major(self.slots * rc_rows if self.keeps_rc else 1, VEC),
                                   1024 if self.ring == "wgmma" else 16)
        # this CTA's tokens' partial rows as pushed by each CTA of the cluster, and every token's gates
        received = smem.allocate_tensor(Float32, du.row_major(self.slots, self.cluster, self.own, ROW), 16)
        gates = smem.allocate_tensor(Float32, du.row_major(self.slots, self.tokens, GATES), 16)
        # partials[slots], gates[slots], and with MMA warps rc_full[slots] (the tile's residual_cur is in sRc), or
        # with collapse warps rc_stored[slots] (the loaders' residual_cur stores of the tile are done) and
        # collapsed[slots] (the collapse warps are done with the tile's gates)
        kinds = 3 if self.mma_warps else 4 if self.collapse_warps else 2
        if cutlass.const_expr(self.reserve):
            smem.allocate_tensor(cutlass.Int8, du.row_major(self.reserve * 1024), 1024)
        mbar = smem.allocate_tensor(cutlass.Int64, du.row_major(kinds * self.slots), 8)
        # "bulk": one mbarrier per ring stage of each MMA warp, completed by the stage's bulk copy; "wgmma": per stage
        # of the warpgroup's ring a full one (the bulk copy) and then an empty one (each MMA warp, once its MMAs of
        # the stage are done)
        rings = {"bulk": self.mma_warps, "wgmma": 2 * self.wgs if self.mma_warps else 0}
        wfull = (smem.allocate_tensor(cutlass.Int64, du.row_major(rings[self.ring] * self.lookahead), 8)
                 if self.ring in rings else mbar)
        # "project": each projecting warp's partial rows of the tile, summed over the warps in order before the push
        # (the other modes pass ``received`` in its place, unread, so that their shared memory stays as measured)
        sRed = (smem.allocate_tensor(Float32, du.row_major(self.proj_warps, self.tokens, ROW), 16)
                if self.sync == "project" and self.ring != "wgmma" else received)
        mma_threads = du.WARP * self.mma_warps
        mma_warp = tidx >= self.mma_first if self.mma_warps else tidx < 0  # (never, without MMA warps)
        collapse_warp = tidx >= self.collapse_first if self.collapse_warps else tidx < 0  # (likewise)
        projecting = mma_warp if self.mma_warps else loader
        if cutlass.const_expr(self.ring == "bulk"):  # the projection's weight ring
            wbuf = smem.allocate_tensor(Float32, du.row_major(self.proj_warps * self.lookahead, BLOCK_FLOATS), 128)
        elif cutlass.const_expr(self.ring == "wgmma"):  # the ring's stages (``a_layout`` reads them)
            wbuf = smem.allocate_tensor(BFloat16, du.row_major(self.wgs * self.lookahead * self.stage_elems()), 1024)
            # the epilogue's exchanges (``d_floats``), right after the ring: what its last stage's unread rows read
            sD = smem.allocate_tensor(Float32, du.row_major(self.d_floats()), 16)
            # the tile's squares, per token and 64 K positions of the slice, from the loaders' post-map
            sSq = smem.allocate_tensor(Float32, du.row_major(self.slots, self.tokens, self.octets // 8), 16)
        elif cutlass.const_expr(self.ring != "cp.async"):
            wbuf = cute.make_rmem_tensor((self.lookahead, MIXES // MMA_N, VEC), Float32)
        else:
            wbuf = smem.allocate_tensor(Float32, du.row_major(self.proj_warps, self.lookahead, MIXES // MMA_N, 2,
                                                              du.WARP, 4), 16)
        if cutlass.const_expr(self.sync == "project" and self.carry and self.ring not in rings):
            if projecting:
                for i in cutlass.range_constexpr(self.lookahead):
                    self.fetch_weights(mFn, wbuf, i, i, rank)
        partial_bytes = self.cluster * self.own * ROW * 4
        gate_bytes = self.tokens * GATES * 4
        if tidx == 0:
            for i in cutlass.range_constexpr(2 * self.slots):
                cute.arch.mbarrier_init(mbar.iterator + i, 1)
            if cutlass.const_expr(self.mma_warps or self.collapse_warps):
                for i in cutlass.range_constexpr(self.slots):
                    cute.arch.mbarrier_init(mbar.iterator + 2 * self.slots + i, self.threads)
            if cutlass.const_expr(self.collapse_warps):
                for i in cutlass.range_constexpr(self.slots):
                    cute.arch.mbarrier_init(mbar.iterator + 3 * self.slots + i, du.WARP * self.collapse_warps)
            if cutlass.const_expr(self.ring in rings):
                for i in cutlass.range_constexpr(rings[self.ring] * self.lookahead):
                    arrivals = 4 if self.ring == "wgmma" and i >= self.wgs * self.lookahead else 1
                    cute.arch.mbarrier_init(wfull.iterator + i, arrivals)
            cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive()  # every CTA's mbarriers are initialised before any push
        cute.arch.cluster_wait()
        # one loop per role: a register tile carried across the iterations of one role's loop (the loaders' next
        # inputs, the MMA warps' weight ring) is then not live in the others'. With MMA warps each role sets its
        # registers first thing in its branch: ptxas allocates code after a setmaxnreg to that count, and code
        # that two roles reach after different counts to the smaller one (the loaders spilled at the MMA warps'
        # count when the roles set them before the common setup)
        if loader:
            if cutlass.const_expr(self.mma_warps or self.collapse_warps):
                self.set_registers(self.loader_regs)
            for it in cutlass.range(count, unroll=1):
                tile = first + it * self.clusters
                slot = it % self.slots
                if cutlass.const_expr(self.ring == "wgmma"):
                    self.post_map(raw, tile, rank, mRc, sRc, slot * rc_rows, sSq, slot)
                else:
                    self.post_map(raw, tile, rank, mRc, sRc, slot * rc_rows)
                if cutlass.const_expr(self.mma_warps):
                    # this thread's residual_cur of the tile is in shared memory (release: its stores come first;
                    # the warpgroup MMAs read it through the async proxy, hence the fence)
                    if cutlass.const_expr(self.ring == "wgmma"):
                        cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.mbarrier_arrive(mbar.iterator + 2 * self.slots + slot)
                self.load_tile(raw, cutlass.min(tile + self.clusters, n_tiles - 1), rank, mX, mRes, loader)
                if cutlass.const_expr(self.collapse_warps):
                    # the collapse warps are done with this slot's gates (tile it - slots) before this tile's rows
                    # can lead to new ones; then this thread's stores of the tile are announced (after that wait,
                    # so that rc_stored never runs a phase ahead of its reader)
                    if it >= self.slots:
                        cute.arch.mbarrier_wait(mbar.iterator + 3 * self.slots + slot, (it // self.slots - 1) % 2)
                    cute.arch.mbarrier_arrive(mbar.iterator + 2 * self.slots + slot)
                if cutlass.const_expr(not self.mma_warps):
                    # every loading warp of this CTA is past its collapse of tile it - 2 before any of them pushes
                    # tile it's rows: the gates those rows lead to land in that tile's gate slot (without this
                    # barrier, one warp ran a tile ahead of another and the late one collapsed with the next gates:
                    # the first GPU run). With MMA warps, rc_full orders the same (the rows follow every loading
                    # thread's post-map of tile it, which follows its collapse of tile it - 2).
                    cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
                    if cutlass.const_expr(self.sync == "project"):
                        self.project(sRc, slot * rc_rows, rank, mFn, sRed, wbuf)
                        cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)  # sRed complete
                    self.push_partials(tile, rank, received, mbar, slot, sRed, 0, self.threads)
                if tidx == 0:  # this tile's gates: counted on this slot's next phase
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator + self.slots + slot, gate_bytes)
                if cutlass.const_expr(not self.collapse_warps):
                    if it >= self.slots - 1:
                        self.collapse_when_gated(it - (self.slots - 1), first, rank, sRc, mRc, gates, mbar, mLi)
            for k in cutlass.range_constexpr(0 if self.collapse_warps else self.slots - 1):  # the last tiles'
                if count - (self.slots - 1) + k >= 0:
                    self.collapse_when_gated(count - (self.slots - 1) + k, first, rank, sRc, mRc, gates, mbar,
                                             mLi)
        elif mma_warp:
            if cutlass.const_expr(self.mma_warps):
                self.set_registers(self.mma_regs)
                # the MMA warps: the tile's projection once every loading thread has post-mapped it, overlapping
                # their post-map of the next tile and their collapse of the previous one
                if cutlass.const_expr(self.ring == "bulk"):
                    for n in cutlass.range_constexpr(self.lookahead):  # the ring's first blocks
                        self.fetch_block(mFn, wbuf, wfull, n, rank)
                elif cutlass.const_expr(self.ring == "wgmma"):
                    wg = (tidx - self.mma_first) // 128
                    if (tidx - self.mma_first) % 128 == 0:
                        for n in cutlass.range_constexpr(self.lookahead):  # the ring's first stages
                            self.fetch_group(mFn, wbuf, wfull, n, rank, wg)
                for it in cutlass.range(count, unroll=1):
                    tile = first + it * self.clusters
                    slot, parity = it % self.slots, (it // self.slots) % 2
                    cute.arch.mbarrier_wait(mbar.iterator + 2 * self.slots + slot, parity)
                    if cutlass.const_expr(self.ring == "wgmma"):  # (pushes the rows itself)
                        self.project_wgmma(sRc, slot, rank, mFn, received, mbar, wbuf, wfull, sD, sSq,
                                           it * self.wg_groups, wg)
                    else:
                        self.project(sRc, slot * rc_rows, rank, mFn, sRed, wbuf, wfull, it * self.blocks_per_warp)
                        cute.arch.barrier(barrier_id=2, number_of_threads=mma_threads)  # sRed complete
                        self.push_partials(tile, rank, received, mbar, slot, sRed, self.mma_first, mma_threads)
                        cute.arch.barrier(barrier_id=2, number_of_threads=mma_threads)  # sRed read: free
                # no CTA exits with a bulk copy in flight: the ring's last fills, for stages never multiplied
                if cutlass.const_expr(self.ring == "bulk"):
                    self.drain(wfull.iterator + self.proj_warp() * self.lookahead, count * self.blocks_per_warp)
                elif cutlass.const_expr(self.ring == "wgmma"):
                    self.drain(wfull.iterator + wg * self.lookahead, count * self.wg_groups)
        elif tidx < self.threads + du.WARP:
            # the tail warp: this CTA's tokens' rows from every CTA, summed in rank order; gates to every CTA
            if cutlass.const_expr(self.mma_warps or self.collapse_warps):
                self.set_registers(self.tail_regs)
            lane = cute.arch.lane_idx()
            for it in cutlass.range(count, unroll=1):
                slot, parity = it % self.slots, (it // self.slots) % 2
                if lane == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator + slot, partial_bytes)
                cute.arch.mbarrier_wait(mbar.iterator + slot, parity)
                if cutlass.const_expr(self.sync == "project"):
                    self.gates_from_projection(rank, received, gates, mbar, slot)
                else:
                    for i in cutlass.range_constexpr(0, self.own * GATES, du.WARP):
                        e = i + lane
                        if e < self.own * GATES:
                            t, c = e // GATES, e % GATES
                            total = Float32(0.0)
                            for peer in cutlass.range_constexpr(self.cluster):
                                total = total + received[slot, peer, t, c]
                            self.push_gate(du.sigmoid(total), rank * self.own + t, c, gates, mbar, slot)
        elif collapse_warp:
            # the collapse warps: each tile once its gates are in and the loaders' residual_cur stores are done
            # (traced only where they exist: a runtime branch is traced whatever its condition)
            if cutlass.const_expr(self.collapse_warps):
                self.set_registers(self.collapse_regs)
                for it in cutlass.range(count, unroll=1):
                    slot, parity = it % self.slots, (it // self.slots) % 2
                    cute.arch.mbarrier_wait(mbar.iterator + self.slots + slot, parity)
                    cute.arch.mbarrier_wait(mbar.iterator + 2 * self.slots + slot, parity)
                    self.collapse(first + it * self.clusters, rank, sRc, mRc, gates, mLi, 0, slot, collapsing=True)
                    cute.arch.mbarrier_arrive(mbar.iterator + 3 * self.slots + slot)
        elif cutlass.const_expr(self.mma_warps or self.collapse_warps):
            self.set_registers(self.tail_regs)  # the idle warps of the tail warp's warpgroup (its setmaxnreg)
        cute.arch.cluster_arrive()  # no CTA leaves while another may still push into it
        cute.arch.cluster_wait()

    @cute.jit
    def collapse_when_gated(self, it, first, rank, sRc: cute.Tensor, mRc: cute.Tensor, gates: cute.Tensor,
                            mbar: cute.Tensor, mLi: cute.Tensor):
        """The collapse of the cluster's ``it``-th tile once its gates are in (``slots`` - 1 tiles behind the
        post-map)."""
        slot = it % self.slots
        cute.arch.mbarrier_wait(mbar.iterator + self.slots + slot, (it // self.slots) % 2)
        self.collapse(first + it * self.clusters, rank, sRc, mRc, gates, mLi,
                      slot * self.tokens * STREAMS * self.octets, slot)

    @cute.jit
    def push_gate(self, gate: Float32, token, c, gates: cute.Tensor, mbar: cute.Tensor, slot):
        """One gate into every CTA of the cluster (st.async, counted by each one's gate mbarrier of ``slot``)."""
        bits = cute.make_rmem_tensor((1,), Float32)
        bits[0] = gate
        for peer in cutlass.range_constexpr(self.cluster):
            cute.arch.store_async_dsmem(gates.iterator + (slot * self.tokens + token) * GATES + c,
                                        cute.recast_tensor(bits, Int32)[0], mbar.iterator + self.slots + slot, peer)

    @cute.jit
    def gates_from_projection(self, rank, received: cute.Tensor, gates: cute.Tensor, mbar: cute.Tensor, slot):
        """The tail warp of "project": lane c sums column c of each of this CTA's tokens over the cluster in rank
        order; the pre gates ``sigmoid(dot_j * rsqrt(sumsq / 4H + eps))`` go to every CTA."""
        lane = cute.arch.lane_idx()
        for t in cutlass.range_constexpr(self.own):
            total = Float32(0.0)
            for peer in cutlass.range_constexpr(self.cluster):
                total = total + received[slot, peer, t, lane]
            sumsq = cute.arch.shuffle_sync(total, MIXES)
            rstd = du.rsqrt(sumsq * Float32(1.0 / (STREAMS * self.hidden)) + Float32(RMS_EPS))
            if lane < GATES:
                self.push_gate(du.sigmoid(total * rstd), rank * self.own + t, lane, gates, mbar, slot)

    @cute.jit
    def fetch_weights(self, mFn: cute.Tensor, wbuf: cute.Tensor, stage: int, i: int, rank):
        """Weight ring stage ``stage`` := this lane's weights of its block ``i`` (``block_octet``): the 8 K positions
        of its octet in weight rows 8 n + g, two 16-byte pieces per row (loads into registers, or cp.async into
        the lane's own shared-memory pieces, one commit group per block)."""
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.ring == "synthetic"):
            # a clock bit in every value: weights that do not depend on the tile would be hoisted out of the tile
            # loop and kept live across it (spills)
            base = Float32(lane + (cute.arch.clock() & 1))
            for nt in cutlass.range_constexpr(MIXES // MMA_N):
                for e in cutlass.range_constexpr(VEC):
                    wbuf[stage, nt, e] = (base + Float32((i * MIXES // MMA_N + nt) * VEC + e)) * Float32(2.0**-12)
            return
        j, o = self.block_octet(i)
        copy = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), Float32, num_bits_per_copy=128)
        for nt in cutlass.range_constexpr(MIXES // MMA_N):
            row = mFn[nt * MMA_N + lane // 4, None]
            for h in cutlass.range_constexpr(2):
                src = cute.local_tile(row, (4,), ((j * self.hidden + rank * (self.hidden // self.cluster) + o * VEC)
                                                  // 4 + h,))
                if cutlass.const_expr(self.ring == "registers"):
                    cute.local_tile(wbuf[stage, nt, None], (4,), (h,)).store(du.load_f32x4(src))
                else:
                    cute.copy(copy, src, wbuf[self.proj_warp(), stage, nt, h, lane, None])
        if cutlass.const_expr(self.ring == "cp.async"):
            cute.arch.cp_async_commit_group()

    @cute.jit
    def weights(self, wbuf: cute.Tensor, stage: int):
        """This lane's weights of the block in ring stage ``stage``, in registers (``(3, 8)``: per column tile)."""
        if cutlass.const_expr(self.ring != "cp.async"):
            return wbuf[stage, None, None].load()
        cute.arch.cp_async_wait_group(self.lookahead - 1)  # the oldest of the blocks in flight has landed
        lane = cute.arch.lane_idx()
        w = cute.make_rmem_tensor((MIXES // MMA_N, VEC), Float32)
        for nt in cutlass.range_constexpr(MIXES // MMA_N):
            for h in cutlass.range_constexpr(2):
                cute.local_tile(w[nt, None], (4,), (h,)).store(wbuf[self.proj_warp(), stage, nt, h, lane, None].load())
        return w.load()

    @cute.jit
    def proj_warp(self):
        """This warp's index among the projecting warps (the loading warps, or the MMA warps after the tail warp)."""
        return cute.arch.warp_idx() - (self.warps + 1 if self.mma_warps else 0)

    @cute.jit
    def block_octet(self, i: int):
        """The stream and the octet (in the CTA's slice) of this lane's K positions in block ``i`` of its warp."""
        lane = cute.arch.lane_idx()
        b = self.proj_warp() + i * self.proj_warps
        per_stream = self.octets // 4
        return b // per_stream, (b % per_stream) * 4 + lane % 4

    @cute.jit
    def fetch_block(self, mFn: cute.Tensor, wbuf: cute.Tensor, wfull: cute.Tensor, n, rank):
        """"bulk": this MMA warp's ring stage ``n % lookahead`` := the weights of its block ``n % blocks_per_warp``
        (the ``n``-th block it projects, counting across tiles): one bulk copy by lane 0, counted by the stage's
        mbarrier."""
        warp_i = self.proj_warp()
        stage = warp_i * self.lookahead + n % self.lookahead
        b = warp_i + (n % self.blocks_per_warp) * self.proj_warps
        if cute.arch.lane_idx() == 0:
            bulk_fill(mFn[rank * self.blocks + b, None], wbuf[stage, None], wfull.iterator + stage)

    @cute.jit
    def drain(self, full, end):
        """Wait for the fills ``end`` .. ``end + lookahead - 1`` of a ring whose full mbarriers start at ``full``."""
        for k in cutlass.range_constexpr(self.lookahead):
            cute.arch.mbarrier_wait(full + (end + k) % self.lookahead, ((end + k) // self.lookahead) % 2)

    def a_layout(self):
        """"wgmma": the A tiles of the rings, per stage (64 rows x 128 K positions, ``stage_elems`` apart): 8 x 8
        core matrices (8 rows x 16 bytes), K first, so that an 8-row slab of a group is contiguous (``WG_ROW_GROUP``
        elements); step u's tile starts 128 elements on."""
        rows = MIXES * self.terms if self.tokens_m else WG_ROWS  # (as the MMAs' N: exactly the terms' rows)
        inner = cute.make_layout(((8, rows // 8), (8, WG_GROUP * WG_K // 8), self.wgs * self.lookahead),
                                 stride=((8, WG_ROW_GROUP), (1, 64), self.stage_elems()))
        return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, inner)

    @cute.jit
    def fetch_group(self, mFn: cute.Tensor, sA: cute.Tensor, wfull: cute.Tensor, n, rank, wg):
        """"wgmma", by one thread of warpgroup ``wg``: its ring stage ``n % lookahead`` := the A tiles of the
        ``n``-th group it multiplies, counting across tiles (group ``wg + wgs (n % wg_groups)`` of this CTA's K
        slice), one bulk copy counted by the stage's full mbarrier."""
        stage = wg * self.lookahead + n % self.lookahead
        dst = cute.make_tensor(cute.recast_ptr(sA.iterator + stage * self.stage_elems(), dtype=Float32),
                               du.row_major(self.stage_elems() // 2))
        g = wg + self.wgs * (n % self.wg_groups)
        if cutlass.const_expr(self.free_weights):
            cute.arch.mbarrier_arrive(wfull.iterator + stage)
        else:
            bulk_fill(mFn[rank * self.groups + g, None], dst, wfull.iterator + stage)

    @cute.jit
    def issue_group(self, tiled_mma, weights: list, acts: cute.Tensor, acc: list, wfull: cute.Tensor, n, g, slot, wg):
        """"wgmma": once warpgroup ``wg``'s ring stage ``n % lookahead`` has landed, the ``WG_GROUP`` MMAs of the
        tile's group ``g`` into ``acc`` (per MMA of a step, weight tiles ``weights``; residual_cur ``acts``), the first
        one overwriting it; one commit group (no wait between its MMAs: ptxas serialises the MMAs of a commit group
        that has one)."""
        stage = wg * self.lookahead + n % self.lookahead
        cute.arch.mbarrier_wait(wfull.iterator + stage, (n // self.lookahead) % 2)
        warpgroup.fence()
        mma_atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom per group: its ACCUMULATE flag changes
        mma_atom.set(warpgroup.Field.ACCUMULATE, False)
        for u in cutlass.range_constexpr(WG_GROUP):
            for i in cutlass.range_constexpr(self.mmas()):
                w, x = weights[i][(None, None, u, stage)], acts[(None, None, g * WG_GROUP + u, slot)]
                cute.gemm(mma_atom, acc[i], *((x, w) if self.tokens_m else (w, x)), acc[i])
            mma_atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def retire_group(self, acc: list, dots: list, mFn: cute.Tensor, sA: cute.Tensor, wfull: cute.Tensor, n, rank,
                     pending: int, wg):
        """"wgmma": once the group of warpgroup ``wg``'s ring stage ``n % lookahead`` is done (``pending`` later
        groups may still run), ``acc`` is added into ``dots`` (per m64 MMA of a step) and each of its warps releases
        the stage (its empty mbarrier); its first thread refills it with the group ``lookahead`` on once every warp
        has."""
        warpgroup.wait_group(pending)
        for i in cutlass.range_constexpr(self.mmas()):
            for e in cutlass.range_constexpr(cute.size(acc[i])):
                dots[i][e] = dots[i][e] + acc[i][e]
        empty = wfull.iterator + (self.wgs + wg) * self.lookahead + n % self.lookahead
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(empty)
        if cute.arch.thread_idx()[0] == self.mma_first + 128 * wg:
            cute.arch.mbarrier_wait(empty, (n // self.lookahead) % 2)
            self.fetch_group(mFn, sA, wfull, n + self.lookahead, rank, wg)

    @cute.jit
    def project_wgmma(self, sRc: cute.Tensor, slot, rank, mFn: cute.Tensor, received: cute.Tensor,
                      mbar: cute.Tensor, sA: cute.Tensor, wfull: cute.Tensor, sD: cute.Tensor, sSq: cute.Tensor, n0,
                      wg):
        """The tile's partial rows by the MMA warpgroups (``wg``: this one, taking groups ``wg``, ``wg + wgs``, ...),
        pushed to their owners: per 16 K positions one (two with three terms) bf16 warpgroup MMA, A = the weight's
        bf16 terms from the warpgroup's ring (``a_layout``, rows as ``weight_row`` places them), B = the tile's
        residual_cur (its tokens as N) read in place, or (``tokens_m``) the other way round, one MMA whatever the
        terms (``mma_shape``); per ring stage (``WG_GROUP`` steps, 128 K positions) one
        commit group into the tensor cores' accumulators, then an fp32 add; once a group is done its stage is
        released and refilled (``retire_group``; ``n0``: ring stages the warpgroup multiplied before this tile).
        Then ``push_rows``."""
        mma_tid = cute.arch.thread_idx()[0] - self.mma_first
        shape = self.mma_shape()
        op = warpgroup.MmaF16BF16Op(BFloat16, Float32, (*shape, WG_K), warpgroup.OperandSource.SMEM,
                                    OperandMajorMode.K, OperandMajorMode.K)
        tiled_mma = cute.make_tiled_mma(cute.make_mma_atom(op), (1, 1, 1))
        thr_mma = tiled_mma.get_slice(mma_tid % 128)
        # residual_cur as the MMAs' operand: K_SW128 (``rc_row``), its 16 or 32 tokens as N, or as the first of M's
        # 64 rows (the rest, 8-row groups 1 KB apart, fall on the next 64 K positions' rows: read, never used)
        rc_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        k_slice = self.k_steps * WG_K
        if cutlass.const_expr(self.tokens_m):
            chunk = self.tokens * 64  # elements per 64 K positions of the tile
            rc_layout = cute.make_layout(((8, WG_ROWS // 8), (64, k_slice // 64), self.slots),
                                         stride=((64, 512), (1, chunk), chunk * (k_slice // 64)))
        else:
            rc_layout = cute.tile_to_shape(rc_atom, (self.tokens, k_slice, self.slots), order=(0, 1, 2)).outer
        # (the MMA wants the swizzle on the pointer, the layout affine)
        sX = cute.make_tensor(cute.recast_ptr(sRc.iterator, rc_atom.inner, BFloat16), rc_layout)
        # the weight's tiles: the first MMA's after the second's three slabs (three terms, weight as M), or at the
        # stage's start
        first = 3 * WG_ROW_GROUP if self.mmas() == 2 else 0
        sW = [cute.make_tensor(sA.iterator + off, self.a_layout()) for off in (first, 0)[:self.mmas()]]
        if cutlass.const_expr(self.tokens_m):
            acts = thr_mma.make_fragment_A(thr_mma.partition_A(sX))
            weights = [thr_mma.make_fragment_B(thr_mma.partition_B(w)) for w in sW]
        else:
            acts = thr_mma.make_fragment_B(thr_mma.partition_B(sX))
            weights = [thr_mma.make_fragment_A(thr_mma.partition_A(w)) for w in sW]
        # two accumulator sets: a pair of groups issued back to back, the second's MMAs running while the first's
        # are added up. (Pairs, not a rolling pipeline: with a group in flight across the loop's back edge, the
        # loop's register copies read its accumulators (C7514); unrolled, ptxas ran short of registers (C7511);
        # either way it serialised every MMA.)
        acc = [[cute.make_rmem_tensor(thr_mma.partition_shape_C(shape), Float32) for _ in range(self.mmas())]
               for _ in range(2)]
        dots = [cute.make_rmem_tensor(thr_mma.partition_shape_C(shape), Float32) for _ in range(self.mmas())]
        for d in dots:
            d.fill(0.0)
        for i in cutlass.range(self.wg_groups // 2, unroll=1):
            for h in cutlass.range_constexpr(2):
                local = 2 * i + h
                self.issue_group(tiled_mma, weights, acts, acc[h], wfull, n0 + local, wg + self.wgs * local, slot, wg)
            for h in cutlass.range_constexpr(2):
                self.retire_group(acc[h], dots, mFn, sA, wfull, n0 + 2 * i + h, rank, 1 - h, wg)
        if cutlass.const_expr(self.wg_groups % 2):  # an odd group out
            local = self.wg_groups - 1
            self.issue_group(tiled_mma, weights, acts, acc[0], wfull, n0 + local, wg + self.wgs * local, slot, wg)
            self.retire_group(acc[0], dots, mFn, sA, wfull, n0 + local, rank, 0, wg)
        self.push_rows(dots, thr_mma, slot, rank, received, mbar, sD, sSq, wg)

    @cute.jit
    def push_rows(self, dots: list, thr_mma, slot, rank, received: cute.Tensor, mbar: cute.Tensor, sD: cute.Tensor,
                  sSq: cute.Tensor, wg):
        """"wgmma": the tile's partial rows from the MMA warpgroups' sums ``dots``, pushed (``push_value``): per
        column (hi + lo) or (hi + mid) + lo, then the warpgroups in order; the squares (``sSq``, from the post-map)
        in column ``MIXES``; zeros after. Each thread adds the terms it holds (``sum_entry``; with the weight as M
        and three terms, lo comes through ``sD``), the second warpgroup's sums through ``sD``."""
        mma_tid = cute.arch.thread_idx()[0] - self.mma_first
        mma_threads = du.WARP * self.mma_warps
        warp, lane = (mma_tid % 128) // du.WARP, cute.arch.lane_idx()
        per = self.sums_per_thread()
        sums = cute.make_rmem_tensor((per,), Float32)
        # wgmma's accumulator layout: thread (warp w, lane l) holds rows 16 w + l // 4 + 8 r and columns
        # 8 j + 2 (l % 4) + e at value 4 j + 2 r + e
        if cutlass.const_expr(self.tokens_m):  # rows: tokens; columns: term t of weight column c at 24 t + c
            for r in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(MIXES // 8):
                    for e in cutlass.range_constexpr(2):
                        entry = dots[0][4 * j + 2 * r + e]
                        for term in cutlass.range_constexpr(1, self.terms):
                            entry = entry + dots[0][4 * (j + MIXES // 8 * term) + 2 * r + e]
                        sums[(r * (MIXES // 8) + j) * 2 + e] = entry
        else:  # rows: the weight's (``weight_row``: r = 0 its first term, r = 1 its second); columns: tokens
            for j in cutlass.range_constexpr(self.tokens // 8):
                for e in cutlass.range_constexpr(2):
                    sums[2 * j + e] = dots[0][4 * j + e] + dots[0][4 * j + 2 + e]
            if cutlass.const_expr(self.terms == 3):  # lo: the second MMA's rows 0-23, through this warpgroup's sD
                lo = cute.make_tensor(sD.iterator + wg * WG_ROWS * self.tokens, du.row_major(WG_ROWS, self.tokens))
                thr_mma.partition_C(lo).store(dots[1].load())
                cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)
                if warp < 3:
                    for kl in cutlass.range_constexpr(per):
                        t, c = self.sum_entry(kl, warp, lane)
                        sums[kl] = sums[kl] + lo[c, t]
                cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)  # read: free for the next tile's
        if cutlass.const_expr(self.wgs == 2):  # the second warpgroup's sums, added by the first
            other = cute.make_tensor(sD.iterator + self.wgs * WG_ROWS * self.tokens,
                                     du.row_major(self.slots, 128, per))
            if wg == 1:
                other[slot, mma_tid % 128, None].store(sums.load())
            cute.arch.barrier(barrier_id=2, number_of_threads=mma_threads)
            if wg == 0:
                theirs = other[slot, mma_tid, None].load()
                for kx in cutlass.range_constexpr(per):
                    sums[kx] = sums[kx] + theirs[kx]
        if wg == 0:
            if warp < (self.tokens // 16 if self.tokens_m else 3):  # the warps that hold rows
                for kp in cutlass.range_constexpr(per):
                    tp, cp = self.sum_entry(kp, warp, lane)
                    self.push_value(sums[kp], tp, cp, rank, received, mbar, slot)
            elif warp == 3:  # per token the squares and the zero columns, eight entries
                for ks in cutlass.range_constexpr(self.tokens // 4):
                    i = lane + du.WARP * ks
                    ts, cs = i // 8, MIXES + i % 8
                    squares = Float32(0.0)
                    if cs == MIXES:
                        squares = self.token_squares(sSq, slot, ts)
                    self.push_value(squares, ts, cs, rank, received, mbar, slot)

    def sum_entry(self, k: int, warp, lane):
        """"wgmma": (token, column) of an MMA thread's ``k``-th sum (``push_rows``)."""
        if self.tokens_m:
            r, j, e = k // (MIXES // 4), k // 2 % (MIXES // 8), k % 2
            return 16 * warp + lane // 4 + 8 * r, 8 * j + 2 * (lane % 4) + e
        return 8 * (k // 2) + 2 * (lane % 4) + k % 2, 8 * warp + lane // 4

    @cute.jit
    def block_weights(self, wbuf: cute.Tensor, stage):
        """"bulk": this lane's weights of the block in ring stage ``stage`` (``(3, 8)``), 16 bytes per column tile
        and half from each of its six 512-byte rows (``blocked_weight``)."""
        lane = cute.arch.lane_idx()
        w = cute.make_rmem_tensor((MIXES // MMA_N, VEC), Float32)
        for nt in cutlass.range_constexpr(MIXES // MMA_N):
            for h in cutlass.range_constexpr(2):
                cute.local_tile(w[nt, None], (4,), (h,)).store(
                    cute.local_tile(wbuf[stage, None], (4,), ((2 * nt + h) * du.WARP + lane,)).load())
        return w.load()

    @cute.jit
    def split_weights(self, w):
        """The weights ``(3, 8)`` as TF32 hi + lo, each in registers."""
        hi = cute.make_rmem_tensor((MIXES // MMA_N, VEC), Float32)
        hi.store(w)
        lo = cute.make_rmem_tensor((MIXES // MMA_N, VEC), Float32)
        if cutlass.const_expr(self.split == "round"):
            du.round_tf32(hi)
            lo.store(w - hi.load())
            du.round_tf32(lo)
        else:  # hi truncated to TF32, lo = the exact rest, truncated by the tensor cores (2^-21 relative)
            bits = cute.recast_tensor(hi, Int32)
            for e in cutlass.range_constexpr(MIXES // MMA_N * VEC):
                bits[e] = bits[e] & -0x2000
            lo.store(w - hi.load())
        return hi, lo

    @cute.jit
    def block_rows(self, sRc: cute.Tensor, row0, i, sq: cute.Tensor):
        """This lane's residual_cur of block ``i`` (rows g and g + 8, its octet), as fp32; their squares into
        ``sq``."""
        g = cute.arch.lane_idx() // 4
        j, o = self.block_octet(i)
        a = [sRc[row0 + self.rc_row(g + 8 * r, j, o), None].load().to(Float32) for r in range(2)]
        for r in cutlass.range_constexpr(2):
            sq[r] = sq[r] + du.sum_squares(a[r])
        return a

    @cute.jit
    def block_mmas(self, atom, a, hi: cute.Tensor, lo: cute.Tensor, acc):
        """The block's four k8 steps: per column tile one MMA with hi and one with lo."""
        for s in cutlass.range_constexpr(4):
            frag_a = cute.make_rmem_tensor((4, 1, 1), TFloat32)
            for e in cutlass.range_constexpr(4):  # (g, q), (g + 8, q), (g, q + 4), (g + 8, q + 4)
                frag_a[e, 0, 0] = a[e % 2][2 * s + e // 2]
            for nt in cutlass.range_constexpr(MIXES // MMA_N):
                for p, part in enumerate((hi, lo)):
                    frag_b = cute.make_rmem_tensor((2, 1, 1), TFloat32)  # (q, g), (q + 4, g)
                    for e in cutlass.range_constexpr(2):
                        frag_b[e, 0, 0] = part[nt, 2 * s + e]
                    chain = (2 * p + s % 2) % self.chains
                    cute.gemm(atom, acc[nt][chain], frag_a, frag_b, acc[nt][chain])

    @cute.jit
    def project(self, sRc: cute.Tensor, row0, rank, mFn: cute.Tensor, sRed: cute.Tensor, wbuf: cute.Tensor,
                wfull: cute.Tensor = None, n0=0):
        """The tile's partial rows over this CTA's K slice on the tensor cores, into ``sRed[warp]``: warp w takes
        the K blocks w, w + warps, ... (block b: octets 4 i .. 4 i + 3 of stream b // (octets / 4)), all 16 tokens
        and 24 columns. Lane (g, q) reads octet q of rows g and g + 8 and the same 8 K positions of weight rows
        8 n + g; elements 2 s and 2 s + 1 of them are its K columns q and q + 4 of k step s (both operands in the
        same K order: a dot product does not depend on it). The weight is split into TF32 hi + lo, two MMAs per
        step (the bf16 activations are exact in TF32). ``wbuf`` is a ring of ``lookahead`` blocks' weights: a
        block's entry is refilled with the weights ``lookahead`` blocks on as soon as it is split (with ``carry``,
        past the last block, the next tile's first blocks: the same weights every tile, loaded during the
        collapse and the post-map). With the "bulk" ring the blocks are a loop (``unroll``), not unrolled code,
        and ``n0`` counts the warp's blocks before this tile.
        """
        lane, warp_i = cute.arch.lane_idx(), self.proj_warp()
        g, q = lane // 4, lane % 4
        atom = cute.make_mma_atom(warp.MmaTF32Op((16, MMA_N, 8)))
        n_tiles = MIXES // MMA_N
        # ``chains`` accumulators per column tile (by weight part, then by k step parity), summed at the end: the
        # MMAs into one accumulator wait for each other
        acc = [[cute.make_rmem_tensor((4, 1, 1), Float32) for _ in range(self.chains)] for _ in range(n_tiles)]
        for nt in cutlass.range_constexpr(n_tiles):
            for c in cutlass.range_constexpr(self.chains):
                acc[nt][c].fill(0.0)
        sq = cute.make_rmem_tensor((2,), Float32)
        sq.fill(0.0)
        if cutlass.const_expr(self.ring == "bulk"):
            for i in cutlass.range(self.blocks_per_warp, unroll=self.unroll):
                n = n0 + i
                stage = warp_i * self.lookahead + n % self.lookahead
                a = self.block_rows(sRc, row0, i, sq)
                cute.arch.mbarrier_wait(wfull.iterator + stage, (n // self.lookahead) % 2)
                hi, lo = self.split_weights(self.block_weights(wbuf, stage))
                # every lane's reads of the stage before the bulk copy (async proxy) refills it with the block
                # ``lookahead`` on: without the fence, ptxas issued the copy with the last read still in flight and
                # the warp-converged sync_warp compiled to nothing (wrong dots in the first GPU run)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_warp()
                self.fetch_block(mFn, wbuf, wfull, n + self.lookahead, rank)
                self.block_mmas(atom, a, hi, lo, acc)
        else:
            if cutlass.const_expr(not self.carry):
                for i in cutlass.range_constexpr(self.lookahead):
                    self.fetch_weights(mFn, wbuf, i, i, rank)
            for i in cutlass.range_constexpr(self.blocks_per_warp):
                stage = i % self.lookahead
                a = self.block_rows(sRc, row0, i, sq)
                hi, lo = self.split_weights(self.weights(wbuf, stage))
                # the stage is free once its weights are split (the split waits for them): the block ``lookahead``
                # on
                nxt = i + self.lookahead
                if cutlass.const_expr(nxt < self.blocks_per_warp):
                    self.fetch_weights(mFn, wbuf, stage, nxt, rank)
                elif cutlass.const_expr(self.carry):
                    self.fetch_weights(mFn, wbuf, stage, nxt - self.blocks_per_warp, rank)
                elif cutlass.const_expr(self.ring == "cp.async"):
                    cute.arch.cp_async_commit_group()  # an empty group: ``lookahead`` groups stay in flight
                self.block_mmas(atom, a, hi, lo, acc)
        for r in cutlass.range_constexpr(2):  # C fragment: rows g and g + 8, columns 8 nt + 2 q and + 1
            for nt in cutlass.range_constexpr(n_tiles):
                for e in cutlass.range_constexpr(2):
                    total = acc[nt][0][2 * r + e, 0, 0]
                    for c in cutlass.range_constexpr(1, self.chains):
                        total = total + acc[nt][c][2 * r + e, 0, 0]
                    sRed[warp_i, g + 8 * r, nt * MMA_N + 2 * q + e] = total
            total = du.warp_sum(sq[r], lanes=4)
            if q == 0:
                sRed[warp_i, g + 8 * r, MIXES] = total
            elif q == 1:  # the row's padding columns, pushed with it
                for c in cutlass.range_constexpr(MIXES + 1, ROW):
                    sRed[warp_i, g + 8 * r, c] = Float32(0.0)

    @cute.jit
    def push_partials(self, tile, rank, received: cute.Tensor, mbar: cute.Tensor, slot, sRed: cute.Tensor,
                      first: int, count: int):
        """The tile's partial rows into their owners' ``received`` (``push_value``). Synthetic rows, or with
        "project" the sums of the warps' rows in warp order."""
        tidx, _, _ = cute.arch.thread_idx()
        for i in cutlass.range_constexpr(0, self.tokens * ROW, count):  # by the threads first .. first + count - 1
            e = i + tidx - first
            if e < self.tokens * ROW:
                t, c = e // ROW, e % ROW
                if cutlass.const_expr(self.sync == "project"):
                    total = sRed[0, t, c]
                    for w in cutlass.range_constexpr(1, self.proj_warps):
                        total = total + sRed[w, t, c]
                    self.push_value(total, t, c, rank, received, mbar, slot)
                else:
                    self.push_value(device_partial(tile * self.tokens + t, c, rank), t, c, rank, received, mbar,
                                    slot)

    @cute.jit
    def token_squares(self, sSq: cute.Tensor, slot, t) -> Float32:
        """"wgmma": token ``t``'s sum of squares over the CTA's K slice, from the post-map's per-row sums in order."""
        total = Float32(0.0)
        for q in cutlass.range_constexpr(self.octets // 8):
            total = total + sSq[slot, t, q]
        return total

    @cute.jit
    def push_value(self, value: Float32, t, c, rank, received: cute.Tensor, mbar: cute.Tensor, slot):
        """Column ``c`` of token ``t``'s partial row into its owner's ``received`` (CTA t // own, at this CTA's
        rank; st.async, counted by the owner's mbarrier of ``slot``)."""
        bits = cute.make_rmem_tensor((1,), Float32)
        bits[0] = value
        dst = received.iterator + ((slot * self.cluster + rank) * self.own + t % self.own) * ROW + c
        cute.arch.store_async_dsmem(dst, cute.recast_tensor(bits, Int32)[0], mbar.iterator + slot, t // self.own)

    @cute.jit
    def post_map(self, raw: cute.Tensor, tile, rank, mRc: cute.Tensor, sRc: cute.Tensor, row0=0, sSq=None, slot=0):
        """residual_cur of the thread's octets to global memory and to shared memory; with ``sSq`` (K-major: eight
        lanes on a token's 64 K positions) their squares too, summed per token and 64 K positions into
        ``sSq[slot]`` (streams in order, then the eight lanes)."""
        for p in cutlass.range_constexpr(self.per_thread):
            t, o, m, vec = self.octet(p, tile, rank)
            sq = Float32(0.0)
            xv = raw[p, 0, None].load().to(Float32)
            rp = [raw[p, 1 + k, None].load().to(Float32) for k in range(STREAMS)]
            for j in cutlass.range_constexpr(STREAMS):
                out = cute.make_rmem_tensor((VEC,), Float32)
                for e in cutlass.range_constexpr(VEC):
                    chain = xv[e] * Float32(post_coef(j))
                    for k in cutlass.range_constexpr(STREAMS):
                        chain = cute.math.fma(Float32(comb_coef(k, j)), rp[k][e], chain)
                    out[e] = chain
                rounded = du.store_bf16x8(cute.local_tile(mRc[m, None], (VEC,), (j * (self.hidden // VEC) + vec,)),
                                          out.load())
                if cutlass.const_expr(self.keeps_rc):
                    sRc[row0 + self.rc_row(t, j, o), None].store(rounded.to(BFloat16))
                if cutlass.const_expr(sSq is not None):
                    sq = sq + du.sum_squares(rounded)
            if cutlass.const_expr(sSq is not None):
                sq = du.warp_sum(sq, lanes=8)
                if cute.arch.lane_idx() % 8 == 0:
                    sSq[slot, t, o // 8] = sq

    @cute.jit
    def collapse(self, tile, rank, sRc: cute.Tensor, mRc: cute.Tensor, gates: cute.Tensor, mLi: cute.Tensor, row0=0,
                 slot=None, collapsing: bool = False):
        """layer_input of the thread's octets, from shared memory or (``collapse_from``) global memory: the octets
        this thread stored in its post-map of the tile, or (``collapsing``) a collapse warp's share of the tile."""
        per = self.tokens * self.octets // (du.WARP * self.collapse_warps) if collapsing else self.per_thread
        for p in cutlass.range_constexpr(per):
            t, o, m, vec = self.octet(p, tile, rank, collapsing)
            if cutlass.const_expr(self.collapse_from == "global"):
                vals = []
                for j in cutlass.range_constexpr(STREAMS):
                    got = cute.make_rmem_tensor((VEC,), BFloat16)
                    cute.autovec_copy(cute.local_tile(mRc[m, None], (VEC,), (j * (self.hidden // VEC) + vec,)), got)
                    vals.append(got.load().to(Float32))
            else:
                vals = [sRc[row0 + self.rc_row(t, j, o), None].load().to(Float32) for j in range(STREAMS)]
            if cutlass.const_expr(self.sync == "none"):
                g = [Float32(0.5)] * STREAMS
            elif cutlass.const_expr(slot is None):
                g = [gates[t, j] for j in range(STREAMS)]
            else:
                g = [gates[slot, t, j] for j in range(STREAMS)]
            out = cute.make_rmem_tensor((VEC,), Float32)
            for e in cutlass.range_constexpr(VEC):
                chain = g[0] * vals[0][e]
                for j in cutlass.range_constexpr(1, STREAMS):
                    chain = cute.math.fma(g[j], vals[j][e], chain)
                out[e] = chain
            du.store_bf16x8(cute.local_tile(mLi[m, None], (VEC,), (vec,)), out.load())


@cute.jit
def bulk_fill(src: cute.Tensor, dst: cute.Tensor, full):
    """One thread: ``dst`` (shared memory) := ``src`` (global) by one bulk copy, counted by the mbarrier ``full``
    (its expected bytes raised by the copy's size first)."""
    cute.arch.mbarrier_arrive_and_expect_tx(full, cute.size(src) * src.element_type.width // 8)
    cute.copy(cute.make_copy_atom(cpasync.CopyBulkG2SOp(), src.element_type), src, dst, mbar_ptr=full)


def compiled(cluster: int, tokens: int, hidden: int, clusters: int, sync: str, threads: int = 224, lookahead: int = 1,
             carry: bool = False, split: str = "round", mma_warps: int = 0, mma_regs: int = 152,
             ring: str = "registers", chains: int = 1, unroll: int = 1, terms: int = 2, kmajor: bool = False,
             slots: int = SLOTS, reserve: int = 0, free_weights: bool = False, tokens_m: bool = False,
             collapse_from: str = "shared", collapse_warps: int = 0, collapse_regs: int = 112):
    skeleton = OnchipSkeleton(cluster, tokens, hidden, clusters, sync, threads, lookahead, carry, split, mma_warps,
                              mma_regs, ring, chains, unroll, terms, kmajor, slots, reserve, free_weights, tokens_m,
                              collapse_from, collapse_warps, collapse_regs)
    return compile_kernel(skeleton, fake_buffer(BFloat16),
                          fake_buffer(BFloat16), fake_buffer(BFloat16), fake_buffer(BFloat16), fake_buffer(Float32))


def blocked_weight(fn, cluster: int):
    """``fn [24, 4 H]`` block by block for the "bulk" ring: CTA rank r's block b (stream b // (octets / 4), octets
    4 (b % (octets / 4)) .. + 3 of the rank's slice) is ``BLOCK_FLOATS`` contiguous floats, six rows of 32 lanes x
    4 (column tile nt, half h of the lane's octet), lane (g, q) holding weight row 8 nt + g at its octet q."""
    h = fn.shape[1] // STREAMS
    per_stream = h // cluster // VEC // 4
    parts = fn.reshape(MIXES // MMA_N, MMA_N, STREAMS, cluster, per_stream, 4, 2, 4)  # nt g j r ob q h e
    return parts.permute(3, 2, 4, 0, 6, 1, 5, 7).contiguous().view(-1)


def weight_row(terms: int, term: int, c, tokens_m: bool = False):
    """"wgmma": the stage row of term ``term`` of weight column ``c``. As the MMAs' N (``tokens_m``): 24 term + c. As
    their M, counting the second MMA's rows after the first's 64: the first two terms (hi, and lo or mid) per 16-row
    block of 8 columns (one MMA warp's accumulator rows), the first in its first 8 rows and the second in the next 8,
    so that each thread holds both for its columns (rows 48-63 unused); three terms: lo in the second MMA's rows
    0-23."""
    if tokens_m:
        return MIXES * term + c
    if term < 2:
        return 16 * (c // 8) + 8 * term + c % 8
    return WG_ROWS + c


def wgmma_weight(fn, cluster: int, terms: int = 2, tokens_m: bool = False):
    """``fn [24, 4 H]`` as the "wgmma" ring's stages (what each bulk copy brings), returned as fp32 words holding bf16
    pairs: per CTA rank r and group G (128 K positions of the rank's slice, streams one after another), 64 rows x 128
    K positions per m64 MMA in ``OnchipSkeleton.a_layout``'s order (8-row slabs of 8 x 8 core matrices, K first:
    element (m, k) at (m // 8) 1024 + (k // 8) 64 + (m % 8) 8 + k % 8), rows as ``weight_row`` places them. Two
    terms: the weight rounded to bf16 (hi) and the rest rounded to bf16 (lo: hi + lo carries 16 of fp32's 24 mantissa
    bits) in the first MMA's rows 0-47 (the slabs of rows 48-63 are not copied). Three terms: hi, mid (the rest after
    hi) there, lo (hi + mid + lo carries all 24 bits) in the second MMA's rows 0-23, whose slabs come first. With
    ``tokens_m`` the terms' 48 or 72 rows one after another (the MMAs' N)."""
    h = fn.shape[1] // STREAMS
    k_slice = STREAMS * h // cluster
    rows = torch.zeros((terms - 1) * WG_ROWS, fn.shape[1], dtype=torch.bfloat16)  # one m64 MMA per 16 K, or two
    for term, part in enumerate(bf16_terms(fn, terms)):  # hi, then lo (two terms) or mid and lo (three)
        rows[[weight_row(terms, term, c, tokens_m) for c in range(MIXES)]] = part
    sets = rows.shape[0] // WG_ROWS
    # the rank's slice in order: K position k of rank r is stream k // (H / S), offset r H / S + k % (H / S)
    per = h // cluster
    k = torch.arange(k_slice)
    cols = (k // per)[None, :] * h + torch.arange(cluster)[:, None] * per + (k % per)[None, :]  # [S, k_slice]
    groups = k_slice // (WG_GROUP * WG_K)
    # set, mg, mi, r, G, kg, ki: row 8 mg + mi of an MMA's rows, K position 128 G + 8 kg + ki of rank r
    tiles = rows[:, cols].reshape(sets, WG_ROWS // 8, 8, cluster, groups, WG_GROUP * WG_K // 8, 8)
    staged = tiles.permute(3, 4, 0, 1, 5, 2, 6).reshape(cluster, groups, sets * WG_SET)  # r G set mg kg mi ki
    stage = staged[:, :, :6 * WG_ROW_GROUP]  # the first MMA's rows 0-47 (tokens_m: rows 0-47, then 48-71)
    if tokens_m and terms == 3:
        stage = staged[:, :, :9 * WG_ROW_GROUP]
    elif terms == 3:  # the second MMA's rows 0-23 before them
        stage = torch.cat([staged[:, :, WG_SET:WG_SET + 3 * WG_ROW_GROUP], stage], 2)
    return stage.contiguous().view(-1).view(torch.float32)


def reference(x, res, rows, cluster: int, sync: str, fn=None):
    """float64 residual_cur and layer_input of the skeleton's arithmetic for the tokens ``rows`` of ``x`` [M, H] and
    ``res`` [M, 4, H] (``fn`` [24, 4 H]: the weight of "project")."""
    x64, r64 = x[rows].double(), res[rows].double()
    rc = torch.stack([x64 * post_coef(j) + sum(comb_coef(k, j) * r64[:, k] for k in range(STREAMS))
                      for j in range(STREAMS)], 1)
    if sync == "project":
        flat = rc.to(torch.bfloat16).double().flatten(1)  # the projection reads the rounded residual_cur
        rstd = torch.rsqrt(flat.square().mean(1, keepdim=True) + RMS_EPS)
        gates = torch.sigmoid(flat @ fn[:GATES].double().T * rstd)
    elif sync != "none":
        total = sum(partial_value(rows[:, None], torch.arange(GATES)[None, :], r) for r in range(cluster))
        gates = torch.sigmoid(total.double())
    else:
        gates = torch.full((len(rows), GATES), 0.5, dtype=torch.float64)
    rc_bf = rc.to(torch.bfloat16).double()  # the collapse reads the rounded residual_cur
    return rc, (gates[:, :, None] * rc_bf).sum(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", type=int, nargs="+", default=[8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 16], help="per tile (T / S tokens per CTA's tail)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--clusters", type=int, default=0, help="resident clusters (0: SMs // cluster - 1)")
    ap.add_argument("--sync", nargs="+", choices=SYNCS, default=list(SYNCS))
    ap.add_argument("--threads", type=int, default=224, help="loading threads per CTA (the tail warp comes on top)")
    ap.add_argument("--lookahead", type=int, nargs="+", default=[1], help='"project": weight blocks in flight per warp')
    ap.add_argument("--carry", type=int, nargs="+", default=[0], help='"project": 1 loads the next tile\'s first '
                    "weight blocks at the end of a tile's projection")
    ap.add_argument("--split", nargs="+", choices=SPLITS, default=["round"], help='"project": the weight\'s hi + lo')
    ap.add_argument("--mma-warps", type=int, nargs="+", default=[0], help='"project": warps of their own for the '
                    "projection (0: the loading warps project)")
    ap.add_argument("--ring", nargs="+", choices=RINGS, default=["registers"], help='"project": where the weight '
                    "blocks in flight wait")
    ap.add_argument("--chains", type=int, nargs="+", default=[1], help='"project": MMA accumulators per column tile')
    ap.add_argument("--unroll", type=int, default=1, help='"project" with the bulk ring: blocks per loop iteration')
    ap.add_argument("--terms", type=int, default=2, choices=(2, 3), help='"project" with the wgmma ring: bf16 terms '
                    "of the weight (3: fp32's 24 mantissa bits)")
    ap.add_argument("--kmajor", action="store_true", help="residual_cur in shared memory K-major, as the wgmma ring "
                    "has it, in every mode")
    ap.add_argument("--slots", type=int, nargs="+", default=[SLOTS], choices=(2, 3), help='"async" and "project": '
                    "tiles in flight (residual_cur, partials and gates buffers; the collapse slots - 1 tiles behind)")
    ap.add_argument("--tokens-m", action="store_true", help='"project" with the wgmma ring: the tile\'s tokens as '
                    "the MMAs' M and every weight term as N (one MMA per 16 K positions whatever the terms)")
    ap.add_argument("--free-weights", action="store_true", help='"project" with the wgmma ring, timing only: the '
                    "weight stages never copied (no L2 traffic for the weight)")
    ap.add_argument("--reserve", type=int, nargs="+", default=[0], help='"async" and "project": KB of shared memory '
                    "allocated and unused (the L1 cache it takes from the loads)")
    ap.add_argument("--collapse-from", nargs="+", choices=COLLAPSE_FROM, default=["shared"], help='"async" and '
                    '"project": where the collapse reads residual_cur (global: the post-map\'s stores, from L2)')
    ap.add_argument("--collapse-warps", type=int, nargs="+", default=[0], help='"async" with --collapse-from global: '
                    "warps of their own for the collapse (0: the loaders collapse)")
    ap.add_argument("--collapse-regs", type=int, default=112, help="registers per collapse-warp thread (setmaxnreg)")
    ap.add_argument("--mma-regs", type=int, nargs="+", default=[152], help="registers per MMA-warp thread (setmaxnreg; "
                    "the loading warps and the tail warp share the rest)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = mb.measure_copy_bandwidth(dev)
    h = args.hidden
    print(f"GPU: {torch.cuda.get_device_name(dev)}, {sms} SMs; copy bandwidth {bw / 1e12:.2f} TB/s; H = {h}")
    g = torch.Generator(device="cpu").manual_seed(0)
    for cluster in args.cluster:
        clusters = args.clusters or sms // cluster - 1
        for tokens in args.tokens:
            m = args.m // tokens * tokens
            x = torch.randn(m, h, generator=g).to(torch.bfloat16)
            res = torch.randn(m, STREAMS, h, generator=g).to(torch.bfloat16)
            xd, resd = x.to(dev), res.to(dev)
            fn = torch.randn(MIXES, STREAMS * h, generator=g) / (STREAMS * h) ** 0.5
            fnd = fn.to(dev)
            prepared = {"bulk": blocked_weight(fn, cluster).to(dev),
                        "wgmma": wgmma_weight(fn, cluster, args.terms, args.tokens_m).to(dev)}
            handoffs = [(sl, kb, cf, cw) for sl in args.slots for kb in args.reserve for cf in args.collapse_from
                        for cw in args.collapse_warps if cw == 0 or cf == "global"]
            variants = [(sync, 1, False, "round", 0, 0, "registers", 1, *h) for sync in args.sync
                        if sync != "project" for h in (handoffs if sync in HANDOFFS else [(SLOTS, 0, "shared", 0)])]
            if "project" in args.sync:
                variants += [("project", la, bool(c), sp, w, r, ring, ch, *h) for ring in args.ring
                             for w in args.mma_warps for la in args.lookahead for c in args.carry for sp in args.split
                             for r in (args.mma_regs if w else [0]) for ch in args.chains for h in handoffs
                             if h[3] == 0]
            for sync, lookahead, carry, split, mma_warps, mma_regs, ring, chains, slots, reserve, cf, cw in variants:
                name = sync if sync != "project" else (f"project ({ring} lookahead {lookahead}, carry {int(carry)}, "
                                                       f"{split}, {chains} chains, {mma_warps} MMA warps" +
                                                       (f", unroll {args.unroll}" if ring == "bulk" else "") +
                                                       (f", {args.terms} terms" if ring == "wgmma" else "") +
                                                       (f" at {mma_regs} registers)" if mma_warps else ")"))
                if args.kmajor and sync != "project":
                    name += ", K-major"
                if slots != SLOTS:
                    name += f", {slots} slots"
                if reserve:
                    name += f", {reserve} KB reserved"
                if cf != "shared":
                    name += f", collapse from {cf}"
                if cw:
                    name += f" by {cw} warps at {args.collapse_regs} registers"
                free = args.free_weights and ring == "wgmma"
                if free:
                    name += ", weights not copied"
                tokens_m = args.tokens_m and ring == "wgmma"
                if tokens_m:
                    name += ", tokens as M"
                try:
                    kernel = compiled(cluster, tokens, h, clusters, sync, args.threads, lookahead, carry, split,
                                      mma_warps, mma_regs or 152, ring, chains, args.unroll, args.terms, args.kmajor,
                                      slots, reserve, free, tokens_m, cf, cw, args.collapse_regs)
                except Exception as e:  # a shape the probe or the DSL refuses: say so, go on
                    print(f"S={cluster} T={tokens} sync={name}: not compiled ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:120]})", flush=True)
                    continue
                rc = torch.full((m, STREAMS, h), float("nan"), device=dev).to(torch.bfloat16)
                li = torch.full((m, h), float("nan"), device=dev).to(torch.bfloat16)
                weight = prepared[ring] if sync == "project" and ring in prepared else fnd.view(-1)
                launch = functools.partial(kernel, xd.view(-1), resd.view(-1), rc.view(-1), li.view(-1), weight)
                launch()
                torch.cuda.synchronize()
                rows = torch.cat([torch.arange(0, m, 97), torch.arange(m - 2 * tokens, m)])  # a spread and the end
                rc_ref, li_ref = reference(x, res, rows, cluster, sync, fn)
                # normwise (the largest error over the largest value): NaN (an element not written) fails; every
                # element is checked written
                rc_err = ((rc[rows.to(dev)].cpu().double() - rc_ref).abs().max() / rc_ref.abs().max()).item()
                li_err = ((li[rows.to(dev)].cpu().double() - li_ref).abs().max() / li_ref.abs().max()).item()
                written = not (rc.isnan().any() or li.isnan().any())
                ok = written and rc_err <= 2**-8 and li_err <= 2**-7
                timing_only = sync == "project" and (ring == "synthetic" or free)
                verdict = "timing only" if timing_only else "ok" if ok else "WRONG"
                us = statistics.median(mb.launch_us(launch, args.reps))
                rate = 20 * h * m / us / 1e6
                print(f"S={cluster} T={tokens:2d} clusters={clusters:2d} sync={name:4s} M={m}: {us:8.1f} us, "
                      f"{rate:5.2f} TB/s = {100 * rate * 1e12 / bw:5.1f}% of copy; "
                      f"{verdict} (rc {rc_err:.1e}, layer_input {li_err:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
