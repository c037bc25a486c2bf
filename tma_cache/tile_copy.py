"""A small CuTe DSL kernel that TMA-loads 2-D tiles through a cached descriptor and writes them out.

It is this package's reference consumer (tests and ``bench/bench_tma_cache.py`` use it), and the
pattern the mhc_cute kernels follow:

* host: ``d = tma_cache.descriptor_for(src, (BM, BN), swizzle=...)``, pass ``d.device_address`` as
  a pointer argument of the compiled (TVM-FFI) function;
* kernel: build the TMA atom from ``src`` exactly as for an inline descriptor (same dtype, box,
  swizzle), then ``cute.copy(atom, g, s, tma_bar_ptr=mbar, tma_desc_ptr=tma_desc_from_address(p))``.

``external_desc=False`` compiles the same kernel with CuTe's inline descriptor (encoded by the
generated host code on every call and passed by value), for comparison.

Inline vs cached, measured on an H200 (bench/bench_tma_cache.py, see tma_cache/README.md): the inline
descriptor costs ~0.01 us of host time per descriptor (C code in the compiled entry point) against
1.2-1.6 us for a ``descriptor_for`` hit, and it is read from param space, whereas the cached one costs
each CTA a tensormap fence + a descriptor fetch from global memory (device time 1.83 -> 1.94 us for one
CTA, 3.26 -> 5.12 us for 448 CTAs). So for CuTe DSL 4.8.1 kernels the inline descriptor is faster for
every operand (fixed weights and activations alike); use external descriptors from tma_cache only where
the descriptor cannot be built inside the compiled function.

Each CTA copies tile ``(blockIdx.x, blockIdx.y)`` of ``src[M, N]`` (row-major, N contiguous) into
``dst[M, N]``; out-of-bounds parts of edge tiles are zero-filled by TMA and not written.
"""

from __future__ import annotations

from typing import Dict, Tuple

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_stream

from .cute_support import fake_desc_pointer, tma_desc_from_address
from .key import Swizzle

__all__ = ["TmaTileCopy", "compile_tile_copy", "tile_copy", "cutlass_dtype"]

_CUTLASS_DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
}


def cutlass_dtype(torch_dtype):
    return _CUTLASS_DTYPES[str(torch_dtype).rsplit(".", 1)[-1]]


class TmaTileCopy:
    """``dst[M, N] = src[M, N]`` tile by tile, each tile loaded by one TMA copy."""

    def __init__(self, dtype, tile: Tuple[int, int] = (64, 64), swizzle: bool = False,
                 external_desc: bool = True, num_threads: int = 128):
        self.dtype = dtype
        self.bm, self.bn = tile
        self.swizzle = swizzle
        self.external_desc = external_desc
        self.num_threads = num_threads
        row_bytes = self.bn * dtype.width // 8
        if swizzle and row_bytes != 128:
            raise ValueError(f"swizzled tile rows must be 128 bytes, got {row_bytes}")

    def _smem_layout(self):
        if self.swizzle:
            atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.dtype)
            return cute.tile_to_shape(atom, (self.bm, self.bn), order=(0, 1))
        return cute.make_layout((self.bm, self.bn), stride=(self.bn, 1))

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, desc: cute.Pointer, stream):
        smem_layout = self._smem_layout()
        tma_atom, tma_src = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), src, smem_layout, (self.bm, self.bn))

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 1]
            tile: cute.struct.Align[cute.struct.MemRange[self.dtype, self.bm * self.bn], 1024]

        self.shared_storage = SharedStorage
        grid = (cute.ceil_div(src.shape[0], self.bm), cute.ceil_div(src.shape[1], self.bn), 1)
        self.kernel(tma_atom, tma_src, dst, desc).launch(
            grid=grid, block=(self.num_threads, 1, 1), smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, tma_atom: cute.CopyAtom, tma_src: cute.Tensor, dst: cute.Tensor,
               desc: cute.Pointer):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mbar = storage.mbar.data_ptr()
        smem_layout = self._smem_layout()  # static: rebuilt here rather than passed from the host
        if cutlass.const_expr(self.swizzle):
            s_tile = storage.tile.get_tensor(smem_layout.outer, swizzle=smem_layout.inner)
        else:
            s_tile = storage.tile.get_tensor(smem_layout)

        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        g_tile = cute.local_tile(tma_src, (self.bm, self.bn), (bidx, bidy))
        # tma_partition wants (tile, rest) on both sides: append a unit mode.
        s_part = cute.group_modes(
            cute.make_tensor(s_tile.iterator, cute.append(s_tile.layout, cute.make_layout(1))), 0, 2)
        g_part = cute.group_modes(
            cute.make_tensor(g_tile.iterator, cute.append(g_tile.layout, cute.make_layout(1))), 0, 2)
        t_s, t_g = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), s_part, g_part)

        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    mbar, self.bm * self.bn * self.dtype.width // 8)
            if cutlass.const_expr(self.external_desc):
                d = tma_desc_from_address(desc)
                cute.copy(tma_atom, t_g[None, 0], t_s[None, 0], tma_bar_ptr=mbar, tma_desc_ptr=d)
            else:
                cute.copy(tma_atom, t_g[None, 0], t_s[None, 0], tma_bar_ptr=mbar)
        cute.arch.mbarrier_wait(mbar, 0)

        m = dst.shape[0]
        n = dst.shape[1]
        for i in cutlass.range(tidx, self.bm * self.bn, self.num_threads):
            r = i // self.bn
            c = i - r * self.bn
            gr = bidx * self.bm + r
            gc = bidy * self.bn + c
            if gr < m and gc < n:
                dst[gr, gc] = s_tile[r, c]


_compiled: Dict[tuple, object] = {}


def compile_tile_copy(torch_dtype, tile=(64, 64), swizzle=False, external_desc=True, arch=None):
    """Compile (and memoise) the kernel for a dtype/tile/swizzle, with fake tensors (no GPU needed).

    The compiled function takes ``(src, dst, desc_address)`` (torch tensors, an int) and runs on the
    current torch stream.
    """
    key = (str(torch_dtype), tuple(tile), bool(swizzle), bool(external_desc), arch)
    fn = _compiled.get(key)
    if fn is None:
        dt = cutlass_dtype(torch_dtype)
        align = 16
        op = TmaTileCopy(dt, tuple(tile), swizzle, external_desc)
        m, n = cute.sym_int(), cute.sym_int()
        lda = cute.sym_int64(divisibility=128 // dt.width)  # row stride: a multiple of 16 bytes
        ldb = cute.sym_int64()
        src = cute.runtime.make_fake_tensor(dt, (m, n), (lda, 1), assumed_align=align)
        dst = cute.runtime.make_fake_tensor(dt, (m, n), (ldb, 1), assumed_align=align)
        options = "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")
        fn = cute.compile(op, src, dst, fake_desc_pointer(), make_fake_stream(use_tvm_ffi_env_stream=True),
                          options=options)
        _compiled[key] = fn
    return fn


def tile_copy(src, dst, tile=(64, 64), swizzle=False, external_desc=True):
    """Run the kernel on torch tensors; with ``external_desc`` the descriptor comes from tma_cache."""
    import tma_cache

    fn = compile_tile_copy(src.dtype, tile, swizzle, external_desc)
    if external_desc:
        d = tma_cache.descriptor_for(src, tuple(tile),
                                     swizzle=Swizzle.B128 if swizzle else Swizzle.NONE)
        fn(src, dst, d.device_address)
    else:
        fn(src, dst, 0)
