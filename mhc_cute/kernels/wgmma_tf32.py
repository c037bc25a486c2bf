"""TF32 warpgroup MMA (``wgmma.mma_async ... .f32.tf32.tf32``) for CuTe DSL 4.8.1.

The DSL's ``cute.nvgpu.warpgroup`` exposes f16/bf16, fp8 and int8 wgmma only (NVIDIA/cutlass#2887), but its
``MmaAtomSM90Type`` accepts TF32 operands: this subclass builds that atom and compiles to
``HGMMA.64xNx8.F32.TF32``. Both operands must be K-major (the PTX rule for 32-bit types); A may come from shared
memory or from registers.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from dataclasses import dataclass  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass._mlir.dialects import cute_nvgpu as _cute_nvgpu_ir  # noqa: E402
from cutlass.cute.atom import make_atom  # noqa: E402
from cutlass.cute.core import _pack_shape  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup  # noqa: E402

TF32_MMA_K = 8


@dataclass(frozen=True)
class MmaTF32Op(warpgroup.MmaOp):
    """``wgmma.m64nNk8.f32.tf32.tf32`` with K-major A and B; ``a_src`` selects registers or shared memory."""

    descriptive_name = "warpgroup TF32 MMA Operation"

    def __init__(self, n: int, a_src: warpgroup.OperandSource = warpgroup.OperandSource.SMEM) -> None:
        super().__init__(
            cutlass.TFloat32, cutlass.TFloat32, cutlass.Float32, (64, n, TF32_MMA_K), a_src,
            OperandMajorMode.K, OperandMajorMode.K,
        )

    def _make_trait(self, *, loc=None, ip=None, **kwargs) -> warpgroup.mma.MmaF16BF16Trait:
        shape_mnk = _pack_shape(self.shape_mnk, loc=loc, ip=ip)
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            shape_mnk.type.attribute,
            self.a_major_mode._to_ir(),
            self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type,
            self.b_dtype.mlir_type,
            self.acc_dtype.mlir_type,
            self.a_src._to_ir(),
        )
        # the trait only carries the ACCUMULATE field, which is type-independent
        accumulate = cutlass.Boolean(False).ir_value(loc=loc, ip=ip)
        return warpgroup.mma.MmaF16BF16Trait(make_atom(ty, [accumulate], loc=loc, ip=ip))


def make_tf32_tiled_mma(n: int, a_src: warpgroup.OperandSource) -> cute.TiledMma:
    """One warpgroup computing a 64 x ``n`` tile per 8-deep K step."""
    return cute.make_tiled_mma(cute.make_mma_atom(MmaTF32Op(n, a_src)), (1, 1, 1))
