"""Host cost of TMA descriptors: cache hit vs encode-every-call vs CuTe's inline encoding.

    python bench/bench_tma_cache.py            # on a device (sm_90+); prints a markdown table

Reports host microseconds per call (best of several rounds of many calls) for:
  * ``tma_cache.descriptor_for`` on a hit (auto-pin on, and off);
  * ``cuTensorMapEncodeTiled`` every call, through cuda-python and through ctypes;
  * a miss (evict + encode + pinned staging + async H2D into the slot);
  * the CuTe inline encoding: host time of a compiled TVM-FFI call whose generated host code encodes
    4 TMA descriptors, minus the same call encoding none, divided by 4;
  * a compiled TMA tile-copy call with the inline descriptor vs with the cached descriptor
    (including the ``descriptor_for`` hit);
and device microseconds per kernel for both tile-copy variants (CUDA graph of 50 launches).
"""


import os
import sys
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tma_cache  # noqa: E402
from mhc_cute.benchmark import replay_us  # noqa: E402
from tma_cache import DescriptorKey, Swizzle  # noqa: E402


def host_us(fn, n=20000, rounds=7, sync=False):
    best = float("inf")
    for _ in range(rounds):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if sync:
            torch.cuda.synchronize()
        best = min(best, dt / n * 1e6)
    return best


def device_us(fn, launches=50, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    times = replay_us(g, launches, reps)
    return times[0], times[len(times) // 2]


def _inline_encode_kernels():
    """Two compiled functions with identical arguments: one encodes 4 TMA descriptors in its host
    code (4 atoms with different boxes, so nothing is deduplicated), one encodes none."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync
    from cutlass.cute.runtime import make_fake_stream

    class Prefetch:
        def __init__(self, n_atoms):
            self.n = n_atoms

        @cute.jit
        def __call__(self, src: cute.Tensor, stream):
            if cutlass.const_expr(self.n == 0):
                self.k0(src).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)
            else:
                atoms = []
                for bm in (8, 16, 32, 64):
                    lay = cute.make_layout((bm, 64), stride=(64, 1))
                    atom, _ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), src, lay, (bm, 64))
                    atoms.append(atom)
                self.k4(atoms[0], atoms[1], atoms[2], atoms[3]).launch(
                    grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

        @cute.kernel
        def k0(self, src: cute.Tensor):
            pass

        @cute.kernel
        def k4(self, a0: cute.CopyAtom, a1: cute.CopyAtom, a2: cute.CopyAtom, a3: cute.CopyAtom):
            with cute.arch.elect_one():
                cpasync.prefetch_descriptor(a0)
                cpasync.prefetch_descriptor(a1)
                cpasync.prefetch_descriptor(a2)
                cpasync.prefetch_descriptor(a3)

    fake = cute.runtime.make_fake_tensor(cutlass.BFloat16, (cute.sym_int(), cute.sym_int()),
                                         (cute.sym_int64(divisibility=8), 1), assumed_align=16)
    out = []
    for n in (0, 4):
        out.append(cute.compile(Prefetch(n), fake, make_fake_stream(use_tvm_ffi_env_stream=True),
                                options="--enable-tvm-ffi"))
    return out


def main():
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    dev = torch.cuda.current_device()
    name = torch.cuda.get_device_name(dev)
    cap = torch.cuda.get_device_capability(dev)
    print(f"GPU: {name} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}, python {sys.version.split()[0]}")
    rows = []

    # decode-size activation of the boundary op: residual [M=64, 4, 7168] bf16, box (64, 1, 64), SW128
    x = torch.randn(64, 4, 7168, device="cuda", dtype=torch.bfloat16)
    box = (64, 1, 64)
    sw = int(Swizzle.B128)
    tma_cache.reset_thread_cache()
    d = tma_cache.descriptor_for(x, box, swizzle=sw)
    rows.append(("cache hit: descriptor_for (auto-pin on)",
                 host_us(lambda: tma_cache.descriptor_for(x, box, swizzle=sw))))
    tma_cache.set_auto_pin(False)
    rows.append(("cache hit: descriptor_for (auto-pin off)",
                 host_us(lambda: tma_cache.descriptor_for(x, box, swizzle=sw))))
    tma_cache.set_auto_pin(True)
    c = tma_cache.current_cache()
    rows.append(("cache hit: DescriptorCache.descriptor_for (bound method)",
                 host_us(lambda: c.descriptor_for(x, box, None, 0, sw))))

    import importlib

    enc = importlib.import_module("tma_cache.encode")
    key: DescriptorKey = d.key
    try:
        enc.driver_module()
        rows.append(("encode every call: cuTensorMapEncodeTiled via cuda-python",
                     host_us(lambda: enc.encode_tiled_cuda_python(key), n=5000)))
    except ImportError:
        rows.append(("encode every call: cuda-python (not installed)", float("nan")))
    rows.append(("encode every call: cuTensorMapEncodeTiled via ctypes",
                 host_us(lambda: enc.encode_tiled_ctypes(key), n=5000)))
    rows.append(("encode every call: key build + validation + encode (DescriptorKey.make)",
                 host_us(lambda: enc.encode_tiled(DescriptorKey.make(
                     device=0, dtype=torch.bfloat16, global_address=x.data_ptr(), global_dim=key.global_dim,
                     global_strides=key.global_strides, box_dim=key.box_dim, swizzle=sw)), n=5000)))

    # pieces of a miss
    from tma_cache.cache import _key_from_tensor

    rows.append(("miss piece: key from tensor + validation",
                 host_us(lambda: _key_from_tensor(x, box, None, 0, sw, 2, 0), n=5000)))
    e = next(iter(c._lru.values()))
    rows.append(("miss piece: eager slot fill (pinned staging + async H2D enqueue)",
                 host_us(lambda: e.pool.fill(e.slot, e.desc.host_bytes, False), n=2000, sync=True)))
    rows.append(("hit piece: torch._C._cuda_isCurrentStreamCapturing()",
                 host_us(torch._C._cuda_isCurrentStreamCapturing)))
    rows.append(("hit piece: key tuple from the tensor",
                 host_us(lambda: (x.get_device(), x.data_ptr(), x.dtype, x.shape, x.stride(), box, None, 0, sw,
                                  2, 0))))

    # miss: capacity 1, two alternating tensors -> every call evicts, encodes, stages, copies
    y = torch.randn_like(x)
    tma_cache.set_capacity(1)
    pair = [x, y]
    i = [0]

    def miss():
        i[0] ^= 1
        tma_cache.descriptor_for(pair[i[0]], box, swizzle=sw)

    rows.append(("cache miss: evict + encode + pinned staging + async H2D", host_us(miss, n=2000, sync=True)))
    tma_cache.set_capacity(128)

    # CuTe inline encoding cost (generated host code), per descriptor
    f0, f4 = _inline_encode_kernels()
    a2d = x.view(64 * 4, 7168)
    f0(a2d)
    f4(a2d)
    torch.cuda.synchronize()
    t0 = host_us(lambda: f0(a2d), n=5000, sync=True)
    t4 = host_us(lambda: f4(a2d), n=5000, sync=True)
    rows.append(("compiled call, 0 inline descriptors (launch baseline)", t0))
    rows.append(("compiled call, 4 inline descriptors", t4))
    rows.append(("CuTe inline encoding, per descriptor ((t4 - t0) / 4)", (t4 - t0) / 4))

    # tile copy: inline descriptor vs cached descriptor
    from tma_cache.tile_copy import compile_tile_copy

    src_small = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    src_big = torch.randn(64, 4 * 7168, device="cuda", dtype=torch.bfloat16)
    f_in = compile_tile_copy(torch.bfloat16, (64, 64), True, False)
    f_ex = compile_tile_copy(torch.bfloat16, (64, 64), True, True)
    dev_rows = []
    for label, src in (("1 tile (64x64 bf16)", src_small), ("448 tiles (64x28672 bf16)", src_big)):
        dst = torch.empty_like(src)
        da = tma_cache.descriptor_for(src, (64, 64), swizzle=sw).device_address
        f_in(src, dst, 0)
        f_ex(src, dst, da)
        torch.cuda.synchronize()
        rows.append((f"tile copy {label}: inline descriptor, host",
                     host_us(lambda: f_in(src, dst, 0), n=5000, sync=True)))
        rows.append((f"tile copy {label}: cached descriptor incl. descriptor_for hit, host",
                     host_us(lambda: f_ex(src, dst, tma_cache.descriptor_for(src, (64, 64), swizzle=sw)
                                          .device_address), n=5000, sync=True)))
        rows.append((f"tile copy {label}: cached descriptor, address precomputed, host",
                     host_us(lambda: f_ex(src, dst, da), n=5000, sync=True)))
        mi, me = device_us(lambda: f_in(src, dst, 0))
        dev_rows.append((f"tile copy {label}: inline descriptor (param space)", mi, me))
        mi, me = device_us(lambda: f_ex(src, dst, da))
        dev_rows.append((f"tile copy {label}: cached descriptor (global memory + tensormap fence)", mi, me))
        assert torch.equal(dst, src)

    print()
    print(f"Host time per call on {name} (best of 7 rounds):")
    print()
    print("| what | host us/call |")
    print("|---|---|")
    for k, v in rows:
        print(f"| {k} | {v:.2f} |")
    print()
    print(f"Device time per kernel on {name} (CUDA graph of 50 launches; min / median of 20 replays):")
    print()
    print("| kernel | min us | median us |")
    print("|---|---|---|")
    for k, a, b in dev_rows:
        print(f"| {k} | {a:.2f} | {b:.2f} |")
    print()
    print("stats:", tma_cache.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
