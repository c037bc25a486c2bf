"""Host time of a compiled CuTe call through TVM-FFI by what it is handed: how many tensors (or raw pointers, as
integers) and how many kernels it launches. Each kernel does nothing but one store, so the time is the host's.

    python bench/probes/probe_ffi_args.py

Lines: ``FFI args launches us`` (median of 9 loops of 2000 calls under ``torch.inference_mode()``).
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


import torch  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402


class Touch:
    """``launches`` one-CTA kernels writing ``first[0]``; the other 15 arguments (tensors, pointers or None) are only
    passed. TVM-FFI takes the current stream from the first tensor's device, so the first is always a tensor."""

    def __init__(self, launches: int):
        self.launches = launches

    @cute.jit
    def __call__(self, first: cute.Tensor, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
                 eps: Float32, reps: Int32, stream):
        for _ in cutlass.range_constexpr(self.launches):
            self.kernel(first, eps).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, first: cute.Tensor, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            first[0] = eps


def compile_touch(n: int, launches: int, pointers: bool):
    def tensor():
        return cute.runtime.make_fake_tensor(Float32, (cute.sym_int(),), (1,), assumed_align=16)

    rest = [cute.runtime.make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=16) if pointers else tensor()
            for _ in range(n - 1)] + [None] * (16 - n)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(Touch(launches), tensor(), *rest, Float32(0.0), Int32(0), stream, options="--enable-tvm-ffi")


def per_call(fn) -> float:
    """Host µs per call of ``fn()`` (``benchmark.host_us_per_call``)."""
    from mhc_cute.benchmark import host_us_per_call

    return host_us_per_call(lambda _s: fn(), None, calls=2000, rounds=9)


def main() -> int:
    ts = [torch.zeros(64, device="cuda") for _ in range(16)]
    ptrs = [t.data_ptr() for t in ts]
    with torch.inference_mode():
        for pointers in (False, True):
            for n in (1, 8, 16):
                for launches in (1, 2):
                    f = compile_touch(n, launches, pointers)
                    args = [ts[0], *(ptrs if pointers else ts)[1:n]] + [None] * (16 - n)
                    us = per_call(lambda: f(*args, 1.0, 20))
                    kind = "pointers" if pointers else "tensors"
                    print(f"FFI {n:2d} {kind:8s} {launches} launch(es) {us:6.2f}", flush=True)
            ints = lambda: [t.data_ptr() for t in ts]  # noqa: E731
            print(f"FFI data_ptr() of 16 tensors {per_call(ints):6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
