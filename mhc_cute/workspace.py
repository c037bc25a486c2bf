"""Scratch buffers of the kernel paths: split-K partials and last-CTA election counters.

One ``Workspace`` per (device, stream): calls on one stream run in order and may share it, calls on two
streams may run concurrently and never do; a call captured into a CUDA graph gets its own
(``get_workspace``), so no graph ever points at a cached buffer. Buffers only grow (a replaced buffer is
freed in stream order, after the kernels already queued on it). Buffers never alias outputs (they are
allocated here, outputs by the dispatcher).

* ``partials(n)``: at least ``n`` fp32, a flat buffer; a kernel views its start as ``[split_k, M, 32]``.
  Contents are scratch: every element a kernel reads was written earlier in the same call.
* ``counters(n)``: at least ``n`` int32, all zero between calls. Zeroed once when allocated (on the stream
  that uses them); the kernels that count on them reset each counter they use to zero before exiting, so no
  zeroing launch is needed per call.
"""

from __future__ import annotations

import threading

import torch


# torch.cuda.is_current_stream_capturing() without its Python frame (asked on every launch)
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _current_stream_handle(device: torch.device) -> int:
    try:
        return torch._C._cuda_getCurrentRawStream(device.index)  # cheap: no Stream object
    except (AttributeError, TypeError):  # pragma: no cover - other torch builds
        return torch.cuda.current_stream(device).cuda_stream


class Workspace:
    """The scratch buffers of one (device, stream)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._partials = torch.empty(0, dtype=torch.float32, device=device)
        self._counters = torch.zeros(0, dtype=torch.int32, device=device)

    def partials(self, n: int) -> torch.Tensor:
        if self._partials.numel() < n:
            self._partials = torch.empty(_grown(n), dtype=torch.float32, device=self.device)
        return self._partials

    def counters(self, n: int) -> torch.Tensor:
        if self._counters.numel() < n:
            self._counters = torch.zeros(_grown(n), dtype=torch.int32, device=self.device)
        return self._counters


def _grown(n: int) -> int:
    """Round up to a power of two (at least 1024 elements) so that a growing M reallocates rarely."""
    return max(1024, 1 << (n - 1).bit_length())


_workspaces: dict[tuple[int, int], Workspace] = {}
_lock = threading.Lock()
# Streams an engine creates and drops (one per request, say) must not pin their scratch forever: past this many
# (device, stream) pairs the oldest is dropped. Safe while its stream still runs: its buffers return to the caching
# allocator in that stream's order, and a later call on it gets a new workspace.
MAX_WORKSPACES = 64


def get_workspace(device: torch.device) -> Workspace:
    """The workspace of ``device``'s current stream; during CUDA-graph capture, a fresh one.

    Graphs captured with torch's defaults all share one capture stream, yet may be replayed concurrently on
    different streams: a call being captured gets buffers of its own from the graph's private pool (its
    counters zeroed by a memset node at every replay), which live exactly as long as the graph.
    """
    if device.type != "cuda" or _is_capturing():
        return Workspace(device)  # (a CPU device: Triton's interpreter, nothing to reuse)
    key = (device.index, _current_stream_handle(device))
    ws = _workspaces.get(key)
    if ws is None:
        with _lock:
            ws = _workspaces.get(key)
            if ws is None:
                if len(_workspaces) >= MAX_WORKSPACES:
                    del _workspaces[next(iter(_workspaces))]  # the oldest (insertion order)
                ws = _workspaces[key] = Workspace(device)
    return ws
