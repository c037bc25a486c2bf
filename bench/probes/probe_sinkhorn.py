"""Cycles per Sinkhorn iteration of ``device_utils.sinkhorn_4x4`` (the chain that ``probe_latency.py`` finds on
the critical path at small M: ~1.7 us for 19 iterations on the H200), timed with ``clock64`` in a one-CTA kernel:
one warp runs the Sinkhorn (one 4x4 per lane, or with ``pair`` one per two lanes, as the big fuse's shapes do),
alone or beside ``busy`` warps streaming a buffer (as the big fuse's collapse warps do). Cycles for ``repeat`` = 1,
20 and 40; the slope is the iteration. The pair form's results are checked bit for bit against the one-lane form's.

    python bench/probes/probe_sinkhorn.py            # on a GPU machine
"""

import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Int64  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mhc_cute.kernels import device_utils as du  # noqa: E402

JUNK_FLOATS = 1 << 24  # 64 MB streamed by the busy warps


class SinkhornProbe:
    def __init__(self, busy_warps: int, pair: bool = False):
        self.busy_warps = busy_warps
        self.pair = pair  # two lanes per token: lane l has rows 2 (l % 2), 2 (l % 2) + 1 of token l // 2
        self.threads = du.WARP * (1 + busy_warps)

    @cute.jit
    def __call__(self, mC: cute.Tensor, mCycles: cute.Tensor, mJunk: cute.Tensor, eps: Float32, repeat: Int32,
                 stream):
        self.kernel(mC, mCycles, mJunk, eps, repeat).launch(grid=[1, 1, 1], block=[self.threads, 1, 1],
                                                            stream=stream)

    @cute.kernel
    def kernel(self, mC: cute.Tensor, mCycles: cute.Tensor, mJunk: cute.Tensor, eps: Float32, repeat: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < du.WARP:
            n = 8 if self.pair else 16
            row, col0 = (tidx // 2, 8 * (tidx % 2)) if self.pair else (tidx, 0)
            c = cute.make_rmem_tensor((n,), Float32)
            for i in cutlass.range_constexpr(n):
                c[i] = mC[row, col0 + i]
            cute.arch.sync_warp()
            t0 = cute.arch.clock64()
            du.sinkhorn_4x4(c, eps, repeat, pair=self.pair)
            cute.arch.sync_warp()
            t1 = cute.arch.clock64()
            for i in cutlass.range_constexpr(n):
                mC[row, col0 + i] = c[i]
            mCycles[tidx] = t1 - t0
        elif cutlass.const_expr(self.busy_warps > 0):
            acc = Float32(0.0)
            n = mJunk.shape[0] // (self.threads - du.WARP)
            for i in cutlass.range(n, unroll=8):
                acc = acc + mJunk[(tidx - du.WARP) + i * (self.threads - du.WARP)]
            if acc == Float32(-1.0):  # never: keeps the loads
                mJunk[0] = acc


def compile_probe(probe: SinkhornProbe):
    """Compiled against fake tensors (no GPU needed), called with torch tensors through TVM-FFI."""
    fake = cute.runtime.make_fake_tensor
    args = (fake(Float32, (32, 16), (16, 1), assumed_align=16), fake(Int64, (32,), (1,), assumed_align=16),
            fake(Float32, (JUNK_FLOATS,), (1,), assumed_align=16))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(probe, *args, Float32(0.0), Int32(0), stream, options="--enable-tvm-ffi")


def main() -> int:
    forms = [(busy, pair) for busy in (0, 7) for pair in (False, True)]
    if not torch.cuda.is_available():
        for busy, pair in forms:
            compile_probe(SinkhornProbe(busy, pair))
        print("compiled (no GPU: nothing timed)")
        return 2
    dev = torch.device("cuda")
    from mhc_cute.reference import sinkhorn

    logits = torch.randn(32, 16, device=dev)
    junk = torch.rand(JUNK_FLOATS, device=dev)
    print(f"GPU: {torch.cuda.get_device_name()}")
    c = torch.empty_like(logits)
    cycles = torch.zeros(32, dtype=torch.int64, device=dev)
    one_lane = {}
    for busy, pair in forms:
        fn = compile_probe(SinkhornProbe(busy, pair))
        tokens = 16 if pair else 32  # the pair form fills the warp with 16 tokens
        per = {}
        for repeat in (1, 20, 40):
            samples = []
            for _ in range(5):
                c.copy_(logits)
                fn(c, cycles, junk, 1e-6, repeat)
                torch.cuda.synchronize()
                samples.append(int(cycles.max()))
            per[repeat] = min(samples)
            ref = sinkhorn(logits[:tokens].double().view(tokens, 4, 4), 1e-6, repeat).view(tokens, 16)
            err = float((c[:tokens].double() - ref).norm() / ref.norm())
            same = ""
            if pair:
                same = f", bitwise same as one lane: {torch.equal(c[:tokens], one_lane[(busy, repeat)][:tokens])}"
            else:
                one_lane[(busy, repeat)] = c.clone()
            print(f"busy_warps={busy} {'pair' if pair else 'lane'} repeat={repeat:2d}: cycles {sorted(samples)} "
                  f"(min {min(samples)}), rel err vs float64 {err:.1e}{same}", flush=True)
        print(f"busy_warps={busy} {'pair' if pair else 'lane'}: {(per[40] - per[20]) / 20:.1f} cycles per iteration",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
