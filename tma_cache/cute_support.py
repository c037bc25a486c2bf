"""CuTe DSL side of tma_cache: turn a descriptor address into the ``tma_desc_ptr`` of ``cute.copy``.

Importing this module imports cutlass. Set ``CUTE_DSL_ARCH=sm_90a`` in the environment *before*
importing cutlass when compiling without a GPU (the DSL otherwise targets sm_100a).

Kernel side (inside a ``@cute.kernel``), for a TMA load whose atom was built as usual with
``cpasync.make_tiled_tma_atom(CopyBulkTensorTileG2SOp(), gmem_tensor, smem_layout, tiler)`` (the
atom must describe the same dtype, box and swizzle as the cached descriptor)::

    desc = tma_desc_from_address(desc_addr)          # desc_addr: the kernel's cute.Pointer argument
    cute.copy(tma_atom, tAgA[None, k], tAsA[None, s], tma_bar_ptr=mbar, tma_desc_ptr=desc)

Host side: compile with ``fake_desc_pointer()`` in the pointer's position, then call the compiled
function with ``tma_cache.descriptor_for(x, tiler, swizzle=...).device_address`` (a plain int is
accepted by the TVM-FFI entry point for a pointer argument).

Measured choice (H200, tma_cache/README.md): with CuTe DSL 4.8.1 the inline descriptor that the
compiled host code encodes itself (~0.01 us) and passes by value is faster than a cached one on the
host (a hit is 1.2-1.6 us of Python) and on the device (no per-CTA fence + global fetch), so CuTe
kernels should keep inline descriptors; this path is for descriptors that cannot be built inside the
compiled function.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import TensorMapManager, TensorMapUpdateMode

from .key import DESCRIPTOR_ALIGN, DESCRIPTOR_BYTES, Swizzle

__all__ = ["tma_desc_from_address", "fake_desc_pointer", "swizzle_of_smem_kind"]

_TMAP = TensorMapManager(TensorMapUpdateMode.GMEM, DESCRIPTOR_BYTES)


def tma_desc_from_address(desc_addr):
    """Device code: descriptor pointer for ``cute.copy(..., tma_desc_ptr=...)`` from the slot address.

    Uses the generic address space (gmem fails in NVVM with 4.8.1) and issues
    ``fence.proxy.tensormap::generic.acquire`` so that a slot refilled by a copy since the last
    launch is observed by the TMA unit (the fence is required: the slot is written through the
    generic proxy, the TMA unit reads through the tensormap proxy). Call it once per thread that
    issues TMA copies, before the first copy.
    """
    desc = _TMAP.get_tensormap_ptr(desc_addr, cute.AddressSpace.generic)
    cpasync.fence_tma_desc_acquire(desc)
    return desc


def fake_desc_pointer():
    """Placeholder for a descriptor-address argument in ``cute.compile`` (128-byte aligned gmem)."""
    return cute.runtime.make_ptr(cutlass.Int64, 0, cute.AddressSpace.gmem, assumed_align=DESCRIPTOR_ALIGN)


def swizzle_of_smem_kind(kind) -> Swizzle:
    """The descriptor swizzle matching a ``warpgroup.SmemLayoutAtomKind`` (K_SW128 -> B128, ...)."""
    name = getattr(kind, "name", str(kind))
    if name.endswith("SW128"):
        return Swizzle.B128
    if name.endswith("SW64"):
        return Swizzle.B64
    if name.endswith("SW32"):
        return Swizzle.B32
    return Swizzle.NONE
