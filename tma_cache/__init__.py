"""tma_cache: cached, device-resident TMA descriptors for CuTe DSL kernels.

Encoding a descriptor from Python (``cuTensorMapEncodeTiled`` via cuda-python) costs 1.6-7 us;
this package encodes each distinct descriptor once, keeps it in a 128-byte aligned slot in device
memory, and hands kernels the slot's address. One bounded LRU per host thread (no locks), keyed on
every field that shapes the descriptor plus the device id; entries used by a captured CUDA graph are
pinned so their slots are never reused while the graph can replay.

Typical use (host side)::

    import tma_cache
    d = tma_cache.descriptor_for(x, (tile_m, 64), swizzle=tma_cache.Swizzle.B128)
    compiled(x, out, d.device_address)        # the kernel takes the address as a cute.Pointer

Kernel side: see :mod:`tma_cache.cute_support` (``desc_ptr = tma_desc_from_address(ptr)``, then
``cute.copy(atom, src, dst, tma_bar_ptr=mbar, tma_desc_ptr=desc_ptr)``).

``import tma_cache`` needs neither a GPU nor cuda-python; the driver is loaded on the first miss.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from .cache import (
    DEFAULT_CAPACITY,
    Descriptor,
    DescriptorCache,
    FakeBackend,
    PinScope,
    TorchCudaBackend,
)
from .key import (
    DESCRIPTOR_ALIGN,
    DESCRIPTOR_BYTES,
    DataType,
    DescriptorKey,
    Interleave,
    L2Promotion,
    OOBFill,
    Swizzle,
    TmaDescriptorError,
    data_type_of,
    element_size,
)

__all__ = [
    "Descriptor",
    "DescriptorCache",
    "DescriptorKey",
    "PinScope",
    "TmaDescriptorError",
    "DataType",
    "Interleave",
    "Swizzle",
    "L2Promotion",
    "OOBFill",
    "FakeBackend",
    "TorchCudaBackend",
    "DESCRIPTOR_BYTES",
    "DESCRIPTOR_ALIGN",
    "descriptor_for",
    "get_descriptor",
    "encode_descriptor",
    "stats",
    "clear",
    "reset_stats",
    "set_capacity",
    "set_auto_pin",
    "pin",
    "unpin_all",
    "configure",
    "current_cache",
    "reset_thread_cache",
    "data_type_of",
    "element_size",
]

_tls = threading.local()
_defaults: dict = {"capacity": DEFAULT_CAPACITY, "encoder": None, "backend": None, "auto_pin": True}


def configure(*, capacity: Optional[int] = None, encoder: Any = None, backend: Any = None,
              auto_pin: Optional[bool] = None) -> None:
    """Set the defaults for caches created after this call (each thread creates its cache lazily).

    ``encoder``: callable ``(DescriptorKey) -> bytes`` (default: the cuda-python driver encoder);
    ``backend``: where slots live (default :class:`TorchCudaBackend`; :class:`FakeBackend` for
    tests without a GPU). Pass ``encoder=False`` / ``backend=False`` to restore the defaults.
    Combine with :func:`reset_thread_cache` to apply them to the calling thread's cache.
    """
    if capacity is not None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        _defaults["capacity"] = int(capacity)
    if encoder is not None:
        _defaults["encoder"] = encoder or None
    if backend is not None:
        _defaults["backend"] = backend or None
    if auto_pin is not None:
        _defaults["auto_pin"] = bool(auto_pin)


def _new_cache() -> DescriptorCache:
    c = DescriptorCache(capacity=_defaults["capacity"], encoder=_defaults["encoder"],
                        backend=_defaults["backend"], auto_pin=_defaults["auto_pin"])
    _tls.cache = c
    return c


def current_cache() -> DescriptorCache:
    """This thread's cache (created on first use)."""
    try:
        return _tls.cache
    except AttributeError:
        return _new_cache()


def reset_thread_cache() -> None:
    """Forget this thread's cache (its pinned entries go with it: only when no graph needs them)."""
    c = getattr(_tls, "cache", None)
    if c is not None:
        c.clear(include_pinned=True)
        del _tls.cache


def descriptor_for(tensor, box_dim, element_strides=None, interleave=0, swizzle=0, l2_promotion=2,
                   oob_fill=0) -> Descriptor:
    """Cached descriptor for ``tensor`` (a CUDA tensor whose last dim is contiguous) on its device.

    ``box_dim`` (and ``element_strides``) are in the tensor's dimension order, outermost first,
    i.e. the CuTe tiler of a row-major tensor: ``descriptor_for(x, (BM, BN))`` for ``x[M, N]``.
    Pass tuples on the hot path. Defaults: no interleave, no swizzle, L2 promotion 128 B, zero OOB
    fill. Returns ``Descriptor(device_address, host_bytes, device, key)``.
    """
    try:
        c = _tls.cache
    except AttributeError:
        c = _new_cache()
    # The hit path of DescriptorCache.descriptor_for, inlined (one Python frame less).
    k = (tensor.get_device(), tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride(),
         box_dim, element_strides, interleave, swizzle, l2_promotion, oob_fill)
    try:
        e = c._lru.get(k)
    except TypeError:
        e = None
    if e is not None and e.valid and not c._capturing():
        c._lru.move_to_end(k)
        c.hits += 1
        return e.desc
    return c.descriptor_for(tensor, box_dim, element_strides, interleave, swizzle, l2_promotion, oob_fill)


def get_descriptor(address, dtype, global_dim, global_strides, box_dim, element_strides=None,
                   interleave=0, swizzle=0, l2_promotion=2, oob_fill=0, device=None) -> Descriptor:
    """Cached descriptor from the raw driver fields (driver order: index 0 is innermost;
    ``global_strides`` in bytes, ``rank - 1`` entries). ``address`` is a data pointer or a tensor;
    ``device`` defaults to the tensor's device or the current device. ``dtype`` is a torch dtype,
    a name such as ``"bf16"``, or a :class:`DataType`."""
    try:
        c = _tls.cache
    except AttributeError:
        c = _new_cache()
    return c.get(address, dtype, global_dim, global_strides, box_dim, element_strides, interleave,
                 swizzle, l2_promotion, oob_fill, device)


def encode_descriptor(key: DescriptorKey) -> bytes:
    """Encode without caching (the driver call); mostly for benchmarks and tests."""
    from .encode import encode_tiled

    return encode_tiled(key)


def stats() -> dict:
    """Counters of this thread's cache: hits, misses, evictions, fills, size, pinned, capacity,
    overflow (entries beyond capacity because everything was pinned), devices."""
    return current_cache().stats()


def clear(include_pinned: bool = False) -> None:
    """Drop this thread's unpinned entries (and pinned ones with ``include_pinned=True``: only when
    no captured graph that used them can be replayed)."""
    current_cache().clear(include_pinned)


def reset_stats() -> None:
    current_cache().reset_stats()


def set_capacity(n: int) -> None:
    """Capacity of this thread's cache (evicts down to it) and the default for new threads."""
    _defaults["capacity"] = int(n)
    current_cache().set_capacity(n)


def set_auto_pin(on: bool) -> None:
    """Auto-pin on capture (default on) for this thread's cache and new ones."""
    _defaults["auto_pin"] = bool(on)
    current_cache().set_auto_pin(on)


def pin(owner: Any = None) -> PinScope:
    """``with tma_cache.pin(owner=graph): ...`` pins every descriptor this thread obtains inside the
    block until ``scope.release()`` or until ``owner`` is garbage collected. Capturing streams are
    detected and pinned automatically; use this for explicit control or with auto-pin off."""
    return current_cache().pin(owner)


def unpin_all() -> None:
    """Unpin every entry of this thread's cache (after the graphs that used them are gone)."""
    current_cache().unpin_all()
