"""What does a grid-wide barrier cost on this GPU? The one open question of the grid-persistent design sketched in
the README (*Where the time goes at large M*): a kernel of ``--ctas`` CTAs, launched cooperatively (so that all
of them are resident and a spin barrier cannot deadlock), that does nothing but ``rounds`` grid barriers. Each
barrier: a CTA barrier, one thread per CTA fences and releases its arrival with an atomic add on a global counter and spins
(acquire loads) until every CTA of this round has arrived, then a CTA barrier. The counter only grows (round r
waits for ``(r + 1) * ctas``), so no reset is needed inside the kernel; the host zeroes it before each launch.

µs per barrier = (time at ``--rounds`` barriers - time at one barrier) / (``--rounds`` - 1), launches timed
back to back with CUDA events (median of ``--reps``).

    python bench/probe_grid_barrier.py --ctas 128 132 --rounds 65
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mhc_cute.kernels import compile_kernel, fake_buffer  # noqa: E402  (first: sets the DSL's target arch)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402


class GridBarrierProbe:
    def __init__(self, ctas: int, threads: int = 128):
        self.ctas, self.threads = ctas, threads

    @cute.jit
    def __call__(self, mCounter: cute.Tensor, a0, a1, a2, a3, rounds: Int32, a5, stream):
        # a0..a5: the six runtime scalars that mhc_cute.kernels.compile_kernel appends; a4 carries ``rounds``
        self.kernel(mCounter, rounds).launch(grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], stream=stream,
                                             cooperative=True)

    @cute.kernel
    def kernel(self, mCounter: cute.Tensor, rounds: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        for r in cutlass.range(rounds, unroll=1):
            cute.arch.sync_threads()
            if tidx == 0:
                cute.arch.fence_acq_rel_gpu()  # as a real kernel would: the CTA's stores before the arrival
                cute.arch.atomic_add(mCounter.iterator, Int32(1), sem="release", scope="gpu")
                target = (r + 1) * self.ctas
                seen = cute.arch.atomic_add(mCounter.iterator, Int32(0), sem="acquire", scope="gpu")
                while seen < target:
                    seen = cute.arch.atomic_add(mCounter.iterator, Int32(0), sem="acquire", scope="gpu")
            cute.arch.sync_threads()


def compiled(ctas: int):
    return compile_kernel(GridBarrierProbe(ctas), fake_buffer(Int32))


def launch_us(fn, counter: torch.Tensor, ctas: int, rounds: int, reps: int) -> float:
    """Median µs per launch of ``rounds`` barriers, each launch after zeroing the counter."""
    times = []
    for _ in range(reps):
        counter.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(counter, 0.0, 0.0, 0.0, 0.0, rounds, 0.0)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    assert counter[0].item() == rounds * ctas, "the barriers did not all complete"
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", type=int, nargs="+", default=[128, 132])
    ap.add_argument("--rounds", type=int, default=65)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    counter = torch.zeros(4, dtype=torch.int32, device=dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}")
    for ctas in args.ctas:
        fn = compiled(ctas)
        launch_us(fn, counter, ctas, 1, 5)  # warm-up
        one = launch_us(fn, counter, ctas, 1, args.reps)
        many = launch_us(fn, counter, ctas, args.rounds, args.reps)
        per = (many - one) / (args.rounds - 1)
        print(f"ctas={ctas:4d} one barrier {one:8.2f} us/launch  {args.rounds} barriers {many:8.2f} us/launch  "
              f"-> {per:.2f} us per grid barrier", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
