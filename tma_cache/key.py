"""The descriptor key (every field that shapes a TMA descriptor) and the hardware rules.

Pure Python: no torch, no CUDA. The enums mirror the driver's ``CUtensorMap*`` values so that
the key can be built and validated on a machine without a driver.

Dimension order is the driver's: index 0 is the innermost (contiguous) dimension. For a row-major
torch tensor of shape ``(R, C)`` that is ``global_dim = (C, R)``, ``global_strides = (C * esize,)``
(bytes, rank - 1 entries: the innermost stride is implicitly one element) and ``box_dim = (bc, br)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Tuple

__all__ = [
    "DataType",
    "Interleave",
    "Swizzle",
    "L2Promotion",
    "OOBFill",
    "DescriptorKey",
    "TmaDescriptorError",
    "element_size",
    "data_type_of",
    "MAX_RANK",
    "MAX_BOX",
    "MAX_ELEMENT_STRIDE",
    "DESCRIPTOR_BYTES",
    "DESCRIPTOR_ALIGN",
]

DESCRIPTOR_BYTES = 128  # sizeof(CUtensorMap)
DESCRIPTOR_ALIGN = 128  # slot alignment we use (the driver wants 64; 128 keeps one per line)
MAX_RANK = 5
MAX_BOX = 256
MAX_ELEMENT_STRIDE = 8
MAX_GLOBAL_DIM = 1 << 32
MAX_GLOBAL_STRIDE = 1 << 40


class TmaDescriptorError(ValueError):
    """A descriptor that the TMA unit (or cuTensorMapEncodeTiled) rejects."""


class DataType(enum.IntEnum):
    """``CUtensorMapDataType``."""

    UINT8 = 0
    UINT16 = 1
    UINT32 = 2
    INT32 = 3
    UINT64 = 4
    INT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT32_FTZ = 10
    TFLOAT32 = 11
    TFLOAT32_FTZ = 12


class Interleave(enum.IntEnum):
    """``CUtensorMapInterleave``."""

    NONE = 0
    B16 = 1
    B32 = 2


class Swizzle(enum.IntEnum):
    """``CUtensorMapSwizzle`` (Hopper supports NONE, B32, B64, B128)."""

    NONE = 0
    B32 = 1
    B64 = 2
    B128 = 3
    B128_ATOM_32B = 4
    B128_ATOM_32B_FLIP_8B = 5
    B128_ATOM_64B = 6


class L2Promotion(enum.IntEnum):
    """``CUtensorMapL2promotion``."""

    NONE = 0
    L2_64B = 1
    L2_128B = 2
    L2_256B = 3


class OOBFill(enum.IntEnum):
    """``CUtensorMapFloatOOBfill``: NONE fills out-of-bounds elements with zeros."""

    NONE = 0
    NAN_REQUEST_ZERO_FMA = 1


_ELEMENT_SIZE = {
    DataType.UINT8: 1,
    DataType.UINT16: 2,
    DataType.UINT32: 4,
    DataType.INT32: 4,
    DataType.UINT64: 8,
    DataType.INT64: 8,
    DataType.FLOAT16: 2,
    DataType.FLOAT32: 4,
    DataType.FLOAT64: 8,
    DataType.BFLOAT16: 2,
    DataType.FLOAT32_FTZ: 4,
    DataType.TFLOAT32: 4,
    DataType.TFLOAT32_FTZ: 4,
}

_FLOAT_TYPES = {
    DataType.FLOAT16,
    DataType.FLOAT32,
    DataType.FLOAT64,
    DataType.BFLOAT16,
    DataType.FLOAT32_FTZ,
    DataType.TFLOAT32,
    DataType.TFLOAT32_FTZ,
}

# Swizzle span in bytes: with interleave NONE the inner box row must fit in it.
_SWIZZLE_SPAN = {
    Swizzle.B32: 32,
    Swizzle.B64: 64,
    Swizzle.B128: 128,
    Swizzle.B128_ATOM_32B: 128,
    Swizzle.B128_ATOM_32B_FLIP_8B: 128,
    Swizzle.B128_ATOM_64B: 128,
}

_NAMED_DTYPES = {
    "uint8": DataType.UINT8, "u8": DataType.UINT8, "int8": DataType.UINT8, "i8": DataType.UINT8,
    "float8_e4m3fn": DataType.UINT8, "float8_e5m2": DataType.UINT8,
    "uint16": DataType.UINT16, "int16": DataType.UINT16,
    "uint32": DataType.UINT32, "int32": DataType.INT32, "i32": DataType.INT32,
    "uint64": DataType.UINT64, "int64": DataType.INT64, "i64": DataType.INT64,
    "float16": DataType.FLOAT16, "half": DataType.FLOAT16, "fp16": DataType.FLOAT16, "f16": DataType.FLOAT16,
    "bfloat16": DataType.BFLOAT16, "bf16": DataType.BFLOAT16,
    "float32": DataType.FLOAT32, "float": DataType.FLOAT32, "fp32": DataType.FLOAT32, "f32": DataType.FLOAT32,
    "float64": DataType.FLOAT64, "double": DataType.FLOAT64, "fp64": DataType.FLOAT64,
    "tfloat32": DataType.TFLOAT32, "tf32": DataType.TFLOAT32,
}


_DTYPE_CACHE: dict = {}


def data_type_of(dtype: Any) -> DataType:
    """Map a torch dtype, a name (``"bf16"``, ``"float32"``...) or a raw enum value to DataType.

    8-bit float and signed-integer types have no TMA type of their own: they move as UINT8.
    """
    if isinstance(dtype, DataType):
        return dtype
    hit = _DTYPE_CACHE.get(dtype)
    if hit is not None:
        return hit
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        try:
            return DataType(dtype)
        except ValueError:
            raise TmaDescriptorError(f"unknown CUtensorMapDataType value {dtype}") from None
    name = dtype if isinstance(dtype, str) else str(dtype)
    name = name.lower().rsplit(".", 1)[-1]  # "torch.bfloat16" -> "bfloat16"
    try:
        dt = _NAMED_DTYPES[name]
    except KeyError:
        raise TmaDescriptorError(f"dtype {dtype!r} has no TMA data type") from None
    try:
        _DTYPE_CACHE[dtype] = dt
    except TypeError:  # unhashable
        pass
    return dt


def element_size(data_type: DataType) -> int:
    return _ELEMENT_SIZE[DataType(data_type)]


def _tuple_of_ints(name: str, v: Any) -> Tuple[int, ...]:
    try:
        return tuple(map(int, v))
    except TypeError:
        raise TmaDescriptorError(f"{name} must be a sequence of ints, got {v!r}") from None


def _enum_table(E) -> dict:
    return {int(m): m for m in E}


_ENUM_TABLES: dict = {}


def _enum_of(E, v, what):
    table = _ENUM_TABLES.get(E)
    if table is None:
        table = _ENUM_TABLES[E] = _enum_table(E)
    m = table.get(v) if type(v) is int or isinstance(v, enum.IntEnum) else None
    if m is None:
        try:
            m = table.get(int(v))
        except (TypeError, ValueError):
            m = None
        if m is None or isinstance(v, bool):
            raise TmaDescriptorError(f"invalid {what} {v!r}; expected one of {[x.name for x in E]}")
    return m


@dataclass(frozen=True)
class DescriptorKey:
    """Every field that shapes a tiled TMA descriptor, plus the device it lives on.

    ``global_strides`` are in bytes and have ``rank - 1`` entries (the driver's convention);
    ``element_strides`` default to all ones.
    """

    device: int
    data_type: DataType
    global_address: int
    global_dim: Tuple[int, ...]
    global_strides: Tuple[int, ...]
    box_dim: Tuple[int, ...]
    element_strides: Tuple[int, ...]
    interleave: Interleave = Interleave.NONE
    swizzle: Swizzle = Swizzle.NONE
    l2_promotion: L2Promotion = L2Promotion.L2_128B
    oob_fill: OOBFill = OOBFill.NONE

    @property
    def rank(self) -> int:
        return len(self.global_dim)

    @property
    def element_size(self) -> int:
        return _ELEMENT_SIZE[self.data_type]

    def as_tuple(self) -> tuple:
        return (
            self.device, int(self.data_type), self.global_address, self.global_dim,
            self.global_strides, self.box_dim, self.element_strides, int(self.interleave),
            int(self.swizzle), int(self.l2_promotion), int(self.oob_fill),
        )

    @classmethod
    def make(
        cls,
        *,
        device: int,
        dtype: Any,
        global_address: int,
        global_dim,
        global_strides,
        box_dim,
        element_strides=None,
        interleave: int = Interleave.NONE,
        swizzle: int = Swizzle.NONE,
        l2_promotion: int = L2Promotion.L2_128B,
        oob_fill: int = OOBFill.NONE,
    ) -> "DescriptorKey":
        """Normalise the fields and check every hardware rule we know (raises TmaDescriptorError)."""
        gd = _tuple_of_ints("global_dim", global_dim)
        gs = _tuple_of_ints("global_strides", global_strides)
        bd = _tuple_of_ints("box_dim", box_dim)
        es = (1,) * len(gd) if element_strides is None else _tuple_of_ints("element_strides", element_strides)
        enum_of = _enum_of
        key = cls(
            device=int(device),
            data_type=data_type_of(dtype),
            global_address=int(global_address),
            global_dim=gd,
            global_strides=gs,
            box_dim=bd,
            element_strides=es,
            interleave=enum_of(Interleave, interleave, "interleave"),
            swizzle=enum_of(Swizzle, swizzle, "swizzle"),
            l2_promotion=enum_of(L2Promotion, l2_promotion, "l2_promotion"),
            oob_fill=enum_of(OOBFill, oob_fill, "oob_fill"),
        )
        key.validate()
        return key

    def validate(self) -> None:
        """Raise TmaDescriptorError for any rule of cuTensorMapEncodeTiled that this key breaks."""
        rank = self.rank
        esize = self.element_size
        err = TmaDescriptorError
        if self.device < 0:
            raise err(f"device must be a CUDA device index, got {self.device}")
        if not 1 <= rank <= MAX_RANK:
            raise err(f"rank must be in 1..{MAX_RANK}, got {rank} (global_dim={self.global_dim})")
        if self.interleave != Interleave.NONE and rank < 3:
            raise err(f"interleaved layouts need rank >= 3, got {rank}")
        if len(self.global_strides) != rank - 1:
            raise err(f"global_strides needs rank - 1 = {rank - 1} entries (bytes, innermost omitted), "
                      f"got {self.global_strides}")
        if len(self.box_dim) != rank:
            raise err(f"box_dim needs {rank} entries, got {self.box_dim}")
        if len(self.element_strides) != rank:
            raise err(f"element_strides needs {rank} entries, got {self.element_strides}")
        addr_align = 32 if self.interleave == Interleave.B32 else 16
        if self.global_address % addr_align:
            raise err(f"global address 0x{self.global_address:x} is not {addr_align}-byte aligned "
                      f"(TMA needs a {addr_align}-byte aligned base)")
        if self.global_address == 0:
            raise err("global address is null")
        for i, d in enumerate(self.global_dim):
            if not 0 < d <= MAX_GLOBAL_DIM:
                raise err(f"global_dim[{i}] = {d} must be in 1..2^32")
        stride_mult = 32 if self.interleave == Interleave.B32 else 16
        for i, s in enumerate(self.global_strides):
            if s <= 0 or s % stride_mult or s >= MAX_GLOBAL_STRIDE:
                raise err(f"global_strides[{i}] = {s} bytes must be a positive multiple of {stride_mult} "
                          f"bytes and < 2^40 (TMA rule: non-innermost strides are multiples of 16 B)")
        for i, b in enumerate(self.box_dim):
            if not 0 < b <= MAX_BOX:
                raise err(f"box_dim[{i}] = {b} is out of range 1..{MAX_BOX} (box too large)")
        for i, e in enumerate(self.element_strides):
            if not 0 < e <= MAX_ELEMENT_STRIDE:
                raise err(f"element_strides[{i}] = {e} is out of range 1..{MAX_ELEMENT_STRIDE}")
        inner_bytes = self.box_dim[0] * esize
        if self.interleave == Interleave.NONE:
            if inner_bytes % 16:
                raise err(f"inner box row is {inner_bytes} bytes (box_dim[0]={self.box_dim[0]} x {esize} B); "
                          f"it must be a multiple of 16 bytes")
            span = _SWIZZLE_SPAN.get(self.swizzle)
            if span is not None and inner_bytes > span:
                raise err(f"inner box row is {inner_bytes} bytes but swizzle {self.swizzle.name} allows at most "
                          f"{span} bytes")
        if self.interleave == Interleave.B32 and self.swizzle != Swizzle.B32:
            raise err("interleave B32 requires swizzle B32")
        if self.oob_fill == OOBFill.NAN_REQUEST_ZERO_FMA and self.data_type not in _FLOAT_TYPES:
            raise err(f"oob_fill NAN_REQUEST_ZERO_FMA needs a floating-point type, got {self.data_type.name}")
