"""Thread-local LRU of TMA descriptors kept in device-resident 128-byte slots.

Design
------
* One :class:`DescriptorCache` per host thread (``threading.local``): no locks, and two threads never
  share mutable state. Keys carry the device id; each device has its own slot pool.
* Hit path: build a tuple key, one dict lookup, ``move_to_end``, one capture-status query, return the
  same :class:`Descriptor` object. O(1).
* Miss path: validate the hardware rules (:mod:`tma_cache.key`), encode once (the injectable encoder,
  by default ``cuTensorMapEncodeTiled`` via cuda-python), take a slot, fill it with an async
  host-to-device copy on the current stream (stream-ordered, legal during CUDA-graph capture).
* CUDA graphs: an entry used while the current stream is capturing (or inside ``with pin():``) is
  *pinned*: it is never evicted and its slot is never reused until it is unpinned
  (``unpin_all()``, ``PinScope.release()``, or garbage collection of the ``owner`` passed to ``pin``).
  A slot filled during capture is filled by a memcpy node of that graph (from a pinned host buffer
  owned by the slot, never rewritten while pinned), so every replay rewrites the same bytes before
  the kernels that read them; since capture executes nothing, the entry is also marked "not filled
  eagerly" and the next eager (or other-graph) use re-issues the copy.
* When every entry is pinned and the cache is full, the cache **grows past its capacity** (a new
  slab chunk; ``stats()["overflow"]`` counts the excess) rather than raising: a model captured into
  one graph may legitimately need more descriptors than the capacity. Unpinning shrinks it back.
* Slot reuse after eviction is FIFO (the freed slot goes to the back of the free list) and the
  refill is ordered on the current stream after earlier kernels of that stream.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from .key import DESCRIPTOR_ALIGN, DESCRIPTOR_BYTES, DescriptorKey, TmaDescriptorError

__all__ = [
    "Descriptor",
    "DescriptorCache",
    "PinScope",
    "TorchCudaBackend",
    "FakeBackend",
    "DEFAULT_CAPACITY",
]

DEFAULT_CAPACITY = int(os.environ.get("TMA_CACHE_CAPACITY", "128"))

Encoder = Callable[[DescriptorKey], bytes]


class Descriptor(NamedTuple):
    """What a kernel needs: the slot's device address (pass it as the kernel's descriptor pointer)
    and the 128 host bytes (for a by-value parameter or for inspection)."""

    device_address: int
    host_bytes: bytes
    device: int
    key: DescriptorKey


class _Entry:
    __slots__ = ("key", "desc", "device", "slot", "pool", "pins", "cap_pin", "valid", "keep", "graph_keep")

    def __init__(self, key, desc, device, slot, pool):
        self.key = key
        self.desc = desc
        self.device = device
        self.slot = slot
        self.pool = pool
        self.pins = 0  # number of holders (capture pin + pin scopes)
        self.cap_pin = False  # pinned because it was used during a capture
        self.valid = False  # the slot holds the bytes outside any graph (eager fill issued)
        self.keep = None  # pinned host buffer of the last eager fill
        self.graph_keep = None  # host buffers read by graph memcpy nodes (kept while pinned)


# --------------------------------------------------------------------------------------------------
# Backends: where slots live and how they are filled. Stateless objects shared by all caches; the
# per-(thread, device) state lives in the pools they create.
# --------------------------------------------------------------------------------------------------


class _SlotPool:
    """Free-list bookkeeping of a pool of descriptor slots; subclasses own the memory (``_grow``, ``fill``,
    ``read``) and fill ``_addr`` (slot -> device address) and ``_free``."""

    def __init__(self, device: int, chunk: int):
        self.device = device
        self._chunk = max(1, chunk)
        self._addr: List[int] = []
        self._free: collections.deque = collections.deque()

    def acquire(self) -> int:
        if not self._free:
            self._grow()
        return self._free.popleft()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def address(self, slot: int) -> int:
        return self._addr[slot]


class _TorchSlotPool(_SlotPool):
    """Slots on one CUDA device: chunks of a uint8 torch tensor, 128-byte aligned."""

    def __init__(self, torch, device: int, chunk: int):
        super().__init__(device, chunk)
        self._torch = torch
        self._views: List[Any] = []
        self._slabs: List[Any] = []
        self._host: List[Any] = []  # per chunk: pinned host slab for capture-time fills
        self._grow()

    def _grow(self) -> None:
        torch = self._torch
        n = self._chunk
        slab = torch.empty(n * DESCRIPTOR_BYTES + DESCRIPTOR_ALIGN, dtype=torch.uint8,
                           device=torch.device("cuda", self.device))
        host = torch.empty(n * DESCRIPTOR_BYTES, dtype=torch.uint8, pin_memory=True)
        base = slab.data_ptr()
        off = (-base) % DESCRIPTOR_ALIGN
        first = len(self._views)
        for i in range(n):
            lo = off + i * DESCRIPTOR_BYTES
            self._views.append(slab[lo:lo + DESCRIPTOR_BYTES])
            self._addr.append(base + lo)
            self._free.append(first + i)
        self._slabs.append(slab)
        self._host.append(host)

    @property
    def nslots(self) -> int:
        return len(self._views)

    def fill(self, slot: int, data: bytes, capturing: bool):
        """Async H2D copy of ``data`` into ``slot`` on the current stream. Returns what must stay alive."""
        torch = self._torch
        if capturing:
            # The graph's memcpy node reads this host region on every replay: it belongs to the
            # slot and is rewritten only when the slot is refilled during a later capture, which
            # cannot happen while the entry is pinned.
            c, i = divmod(slot, self._chunk)
            host = self._host[c][i * DESCRIPTOR_BYTES:(i + 1) * DESCRIPTOR_BYTES]
        else:
            # A fresh pinned buffer per eager fill: torch's host allocator recycles it only after
            # the copy has run, so a queued copy never reads bytes meant for a later occupant.
            host = torch.empty(DESCRIPTOR_BYTES, dtype=torch.uint8, pin_memory=True)
        ctypes.memmove(host.data_ptr(), data, DESCRIPTOR_BYTES)
        self._views[slot].copy_(host, non_blocking=True)
        return host

    def read(self, slot: int) -> bytes:
        """Device bytes of a slot (synchronises; for tests and debugging only)."""
        return bytes(self._views[slot].cpu().tolist())


class TorchCudaBackend:
    """Slots in CUDA memory allocated through torch; fills are ``copy_(pinned, non_blocking=True)``."""

    def __init__(self):
        import torch

        self._torch = torch
        self.is_capturing = torch._C._cuda_isCurrentStreamCapturing

    def new_pool(self, device: int, nslots: int) -> _TorchSlotPool:
        return _TorchSlotPool(self._torch, device, nslots)

    def current_device(self) -> int:
        return self._torch.cuda.current_device()


class _FakeSlotPool(_SlotPool):
    _next_base = itertools.count(1)

    def __init__(self, backend: "FakeBackend", device: int, chunk: int):
        super().__init__(device, chunk)
        self.backend = backend
        self._mem: List[bytearray] = []
        self._grow()

    def _grow(self):
        base = (0x7F00_0000_0000 + (self.device << 36) + next(self._next_base) * (1 << 24))
        first = len(self._mem)
        for i in range(self._chunk):
            self._mem.append(bytearray(DESCRIPTOR_BYTES))
            self._addr.append(base + i * DESCRIPTOR_BYTES)
            self._free.append(first + i)

    @property
    def nslots(self) -> int:
        return len(self._mem)

    def fill(self, slot: int, data: bytes, capturing: bool):
        self.backend.fills.append((self.device, slot, capturing))
        if not capturing:  # a captured copy does not execute until replay
            self._mem[slot][:] = data
        return bytes(data)

    def read(self, slot: int) -> bytes:
        return bytes(self._mem[slot])


class FakeBackend:
    """Host-memory stand-in for tests on machines without a GPU.

    ``capturing`` simulates ``torch.cuda.is_current_stream_capturing()``; ``fills`` logs every
    fill as ``(device, slot, capturing)``.
    """

    def __init__(self, device: int = 0):
        self.capturing = False
        self.device = device
        self.fills: list = []

    def is_capturing(self) -> bool:
        return self.capturing

    def new_pool(self, device: int, nslots: int) -> _FakeSlotPool:
        return _FakeSlotPool(self, device, nslots)

    def current_device(self) -> int:
        return self.device


def _never_capturing() -> bool:
    return False


# --------------------------------------------------------------------------------------------------
# Pinning
# --------------------------------------------------------------------------------------------------


class PinScope:
    """Pins every descriptor obtained (hit or miss) in this thread while the scope is active.

    Pins outlive the ``with`` block: call :meth:`release` once no graph that used them can be
    replayed any more, or pass ``owner=graph`` to release automatically when the owner is garbage
    collected (the release is queued and applied by the owning thread on its next cache miss or
    cache call, since caches are never touched from other threads).
    """

    def __init__(self, cache: "DescriptorCache", owner: Any = None):
        self._cache = cache
        self._entries: List[_Entry] = []
        self._ids: set = set()
        self._active = False
        self._released = False
        cache._live_scopes.add(self)
        if owner is not None:
            pending = cache._pending_release
            weakref.finalize(owner, pending.append, self)

    def __enter__(self) -> "PinScope":
        if self._released:
            raise RuntimeError("this PinScope was released")
        self._active = True
        self._cache._scopes.append(self)
        self._cache._refresh_fast()
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        try:
            self._cache._scopes.remove(self)
        except ValueError:
            pass
        self._cache._refresh_fast()

    def _add(self, e: _Entry) -> None:
        if id(e) not in self._ids:
            self._ids.add(id(e))
            self._entries.append(e)
            self._cache._pin(e)

    @property
    def entries(self) -> int:
        return len(self._entries)

    def release(self) -> None:
        """Unpin what this scope pinned (must be called from the thread that owns the cache)."""
        if self._cache._thread != threading.get_ident():
            raise RuntimeError("PinScope.release() must run on the thread that owns the cache")
        if self._released:
            return
        self._released = True
        if self._active:
            self.__exit__()
        for e in self._entries:
            self._cache._unpin(e)
        self._entries.clear()
        self._ids.clear()
        self._cache._trim()


# --------------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------------


class DescriptorCache:
    """A bounded LRU of TMA descriptors for one host thread (do not share one between threads)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, encoder: Optional[Encoder] = None,
                 backend: Any = None, auto_pin: bool = True):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._encoder = encoder  # None: the driver encoder, resolved (and cuda imported) on first miss
        self._backend = backend
        self._capacity = int(capacity)
        self._lru: "collections.OrderedDict[tuple, _Entry]" = collections.OrderedDict()
        self._pinned: Dict[tuple, _Entry] = {}
        self._pools: Dict[int, Any] = {}
        self._scopes: List[PinScope] = []
        self._pending_release: collections.deque = collections.deque()
        self._live_scopes: "weakref.WeakSet[PinScope]" = weakref.WeakSet()
        self._thread = threading.get_ident()
        self._auto_pin = bool(auto_pin)
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.fills = 0
        self._capturing: Callable[[], bool] = _never_capturing
        self._refresh_fast()

    # ---------------------------------------------------------------- configuration
    def _get_backend(self):
        if self._backend is None:
            self._backend = TorchCudaBackend()
            self._refresh_fast()
        return self._backend

    def _refresh_fast(self) -> None:
        # The hit path asks one callable whether it must take the slow path (pin).
        if self._scopes:
            self._capturing = _always
        elif self._auto_pin and self._backend is not None:
            self._capturing = self._backend.is_capturing
        else:
            self._capturing = _never_capturing

    @property
    def capacity(self) -> int:
        return self._capacity

    def set_capacity(self, n: int) -> None:
        if n < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = int(n)
        self._trim()

    def set_auto_pin(self, on: bool) -> None:
        """Auto-pin entries used while the current stream is capturing (default on). Turning it off
        saves the capture-status query on each hit; you must then wrap captures in ``pin()``."""
        self._auto_pin = bool(on)
        self._refresh_fast()

    # ---------------------------------------------------------------- lookups
    def descriptor_for(self, tensor, box_dim, element_strides=None, interleave=0, swizzle=0,
                       l2_promotion=2, oob_fill=0) -> Descriptor:
        """Descriptor of a strided tensor whose last dimension is contiguous.

        ``box_dim`` and ``element_strides`` are given in the tensor's dimension order (outermost
        first, like ``tensor.shape``); they are reversed into the driver's order on a miss.
        """
        k = (tensor.get_device(), tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride(),
             box_dim, element_strides, interleave, swizzle, l2_promotion, oob_fill)
        try:
            e = self._lru.get(k)
        except TypeError:  # a list somewhere: normalise once
            box_dim = tuple(box_dim)
            element_strides = None if element_strides is None else tuple(element_strides)
            return self.descriptor_for(tensor, box_dim, element_strides, interleave, swizzle,
                                       l2_promotion, oob_fill)
        if e is not None and e.valid and not self._capturing():
            self._lru.move_to_end(k)
            self.hits += 1
            return e.desc
        return self._slow(k, lambda: _key_from_tensor(tensor, box_dim, element_strides, interleave,
                                                      swizzle, l2_promotion, oob_fill))

    def get(self, address, dtype, global_dim, global_strides, box_dim, element_strides=None,
            interleave=0, swizzle=0, l2_promotion=2, oob_fill=0, device=None) -> Descriptor:
        """Descriptor from raw driver fields (driver order: index 0 innermost; strides in bytes,
        rank - 1 entries). ``address`` is a data pointer (int) or a tensor (its data_ptr/device)."""
        if not isinstance(address, int):
            if device is None:
                device = address.get_device()
            address = address.data_ptr()
        if device is None:
            device = self._get_backend().current_device()
        k = ("raw", device, address, dtype, _tup(global_dim), _tup(global_strides), _tup(box_dim),
             None if element_strides is None else _tup(element_strides), interleave, swizzle,
             l2_promotion, oob_fill)
        e = self._lru.get(k)
        if e is not None and e.valid and not self._capturing():
            self._lru.move_to_end(k)
            self.hits += 1
            return e.desc
        return self._slow(k, lambda: DescriptorKey.make(
            device=device, dtype=dtype, global_address=address, global_dim=global_dim,
            global_strides=global_strides, box_dim=box_dim, element_strides=element_strides,
            interleave=interleave, swizzle=swizzle, l2_promotion=l2_promotion, oob_fill=oob_fill))

    def _slow(self, k, build: Callable[[], DescriptorKey]) -> Descriptor:
        if self._pending_release:
            self._drain_pending()
        backend = self._get_backend()
        capturing = self._auto_pin and backend.is_capturing()
        e = self._lru.get(k)
        if e is None:
            e = self._pinned.get(k)
        if e is not None:
            self.hits += 1
            if e.pins == 0:
                self._lru.move_to_end(k)
        else:
            self.misses += 1
            key = build()  # validates: raises TmaDescriptorError before any driver call
            if self._encoder is None:
                from .encode import default_encoder

                self._encoder = default_encoder()
            data = self._encoder(key)
            if len(data) != DESCRIPTOR_BYTES:
                raise TmaDescriptorError(f"encoder returned {len(data)} bytes, expected {DESCRIPTOR_BYTES}")
            e = self._insert(k, key, bytes(data))
        if capturing and not e.cap_pin:
            e.cap_pin = True
            self._pin(e)
        for s in self._scopes:
            s._add(e)
        if not e.valid or capturing:
            if capturing and e.valid:
                pass  # filled eagerly before this capture and now pinned: the slot cannot change
            else:
                self._fill(e, capturing)
        return e.desc

    # ---------------------------------------------------------------- internals
    def _pool(self, device: int):
        p = self._pools.get(device)
        if p is None:
            p = self._get_backend().new_pool(device, self._capacity)
            self._pools[device] = p
        return p

    def _insert(self, k, key: DescriptorKey, data: bytes) -> _Entry:
        pool = self._pool(key.device)
        while self._lru and len(self._lru) + len(self._pinned) >= self._capacity:
            self._evict_one()
        slot = pool.acquire()
        desc = Descriptor(pool.address(slot), data, key.device, key)
        e = _Entry(k, desc, key.device, slot, pool)
        self._lru[k] = e
        return e

    def _fill(self, e: _Entry, capturing: bool) -> None:
        host = e.pool.fill(e.slot, e.desc.host_bytes, capturing)
        self.fills += 1
        if capturing:
            if e.graph_keep is None:
                e.graph_keep = []
            e.graph_keep.append(host)
        else:
            e.keep = host
            e.valid = True

    def _evict_one(self) -> None:
        k, e = self._lru.popitem(last=False)
        self._drop(e)
        self.evictions += 1

    def _drop(self, e: _Entry) -> None:
        e.pool.release(e.slot)
        e.keep = None
        e.graph_keep = None
        e.valid = False

    def _pin(self, e: _Entry) -> None:
        if e.pins == 0:
            self._lru.pop(e.key, None)
            self._pinned[e.key] = e
        e.pins += 1

    def _unpin(self, e: _Entry) -> None:
        if e.pins <= 0:
            return
        e.pins -= 1
        if e.pins == 0 and self._pinned.pop(e.key, None) is e:
            e.graph_keep = None
            self._lru[e.key] = e  # most recently used end

    def _trim(self) -> None:
        while self._lru and len(self._lru) + len(self._pinned) > self._capacity:
            self._evict_one()

    def _drain_pending(self) -> None:
        while self._pending_release:
            s = self._pending_release.popleft()
            s.release()

    # ---------------------------------------------------------------- pinning API
    def pin(self, owner: Any = None) -> PinScope:
        return PinScope(self, owner)

    def unpin_all(self) -> None:
        """Unpin every entry (capture pins and scopes). Call only when no graph that used these
        descriptors can be replayed any more; the entries become ordinary LRU entries."""
        for s in list(self._scopes):
            s.__exit__()
        for s in list(self._live_scopes):
            s._entries.clear()
            s._ids.clear()
        for e in list(self._pinned.values()):
            e.pins = 1
            e.cap_pin = False
            self._unpin(e)
        self._trim()

    # ---------------------------------------------------------------- maintenance
    def clear(self, include_pinned: bool = False) -> None:
        """Drop every unpinned entry. ``include_pinned=True`` also drops pinned entries: only safe
        when no captured graph that used them can be replayed."""
        while self._lru:
            k, e = self._lru.popitem()
            self._drop(e)
        if include_pinned:
            for e in self._pinned.values():
                self._drop(e)
            self._pinned.clear()

    def reset_stats(self) -> None:
        self.hits = self.misses = self.evictions = self.fills = 0

    def stats(self) -> dict:
        size = len(self._lru) + len(self._pinned)
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "fills": self.fills,
            "size": size,
            "pinned": len(self._pinned),
            "capacity": self._capacity,
            "overflow": max(0, size - self._capacity),
            "devices": sorted(self._pools),
        }

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    def keys(self) -> list:
        """Keys in LRU order (least recently used first), then pinned keys."""
        return list(self._lru) + list(self._pinned)

    def read_slot(self, desc: Descriptor) -> bytes:
        """The bytes currently in ``desc``'s slot (synchronising; tests/debugging only)."""
        for e in itertools.chain(self._lru.values(), self._pinned.values()):
            if e.desc is desc:
                return e.pool.read(e.slot)
        raise KeyError("descriptor not in this cache")


def _always() -> bool:
    return True


def _tup(v):
    return v if isinstance(v, tuple) else tuple(v)


def _key_from_tensor(tensor, box_dim, element_strides, interleave, swizzle, l2_promotion,
                     oob_fill) -> DescriptorKey:
    device = tensor.get_device()
    if device < 0:
        raise TmaDescriptorError("tensor is not on a CUDA device")
    shape = tuple(tensor.shape)
    stride = tuple(tensor.stride())
    rank = len(shape)
    if rank == 0:
        raise TmaDescriptorError("a 0-d tensor has no TMA descriptor")
    box = tuple(int(b) for b in box_dim)
    if len(box) != rank:
        raise TmaDescriptorError(f"box_dim {box} must have one entry per tensor dimension {shape}")
    if shape[-1] != 1 and stride[-1] != 1:
        raise TmaDescriptorError(f"the last dimension must be contiguous (stride 1), got strides {stride}")
    esize = tensor.element_size()
    # Strides of size-1 dimensions are meaningless (torch may report anything): give them the
    # compact value rounded up to 16 bytes so they never trip the stride rule.
    gstrides = []
    compact = shape[-1] * esize
    for i in range(rank - 2, -1, -1):
        s = stride[i] * esize
        if shape[i] == 1:
            s = -(-compact // 16) * 16
        gstrides.append(s)
        compact = max(compact, s) * shape[i]
    return DescriptorKey.make(
        device=device,
        dtype=tensor.dtype,
        global_address=tensor.data_ptr(),
        global_dim=shape[::-1],
        global_strides=tuple(gstrides),
        box_dim=box[::-1],
        element_strides=None if element_strides is None else tuple(element_strides)[::-1],
        interleave=interleave,
        swizzle=swizzle,
        l2_promotion=l2_promotion,
        oob_fill=oob_fill,
    )
