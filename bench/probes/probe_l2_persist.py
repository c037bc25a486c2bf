"""Can the delayed seam's fused norm find ``layer_input`` still in L2 when it re-reads it, if part of L2 is set aside
for it?

With the norm, kernel 1 writes the collapse x1 into ``layer_input`` and the big fuse re-reads and rewrites it once
the row's sum of squares is known: 4 H bytes a token beside the floor's 20 H, which holds any such design near 80% of
the floor (``probe_reread_bound.py --delayed``). The L2 evict-last hint did not keep the lines (2026-12-06). This
probe uses CUDA's persisting L2 instead: it sets aside the most L2 the device allows for persisting lines
(``cudaLimitPersistingL2CacheSize``) and, before each call, gives the stream an access policy window over that call's
``layer_input`` (hits persisting, misses streaming, hit ratio the set-aside over the window), so that the norm's
re-read may hit L2 and its rewrite land on the first write's lines, which reach HBM once. Each input set has its own
output buffers, so one call's persisting lines are pushed out (written back) by the next call's.

The window is a stream attribute set from the host, so the rows are timed eagerly: the calls over the rotated sets
enqueued between two events, median of ``--reps`` batches, the rows in alternating order between rounds; the calls
without a window are also timed as CUDA-graph replays (``graph``), to show what the eager timing adds. Rows:

- ``auto`` / ``auto norm``: ``mhc_fused_hc_delayed`` with carried gates, without and with the norm;
- ``stream`` / ``stream + norm pass``: the plain streaming kernels of ``probe_reread_bound.py`` (the one pass of the
  delayed seam, then the in-place scaling of ``layer_input``), no projection: the bound of the byte pattern;
- each of them again with the L2 set aside but no window (``L2 set aside``): what the set-aside costs the rest;
- ``auto norm, li persisting`` / ``stream + norm pass, li persisting``: with the set-aside and the window.

    python bench/probes/probe_l2_persist.py --hidden 7168 5120 --m 2048 4096 8192

Lines: ``PL H M name us floor%`` (the delayed seam's floor at the copy bandwidth measured first).
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_reread_bound as rb  # noqa: E402  (also puts the repository on the path)
import torch  # noqa: E402
import triton  # noqa: E402
from cuda.bindings import runtime as rt  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute import accuracy, mhc_fused_hc_delayed  # noqa: E402
from mhc_cute.problem import MhcFusedHcDelayedOutput, new_outputs  # noqa: E402

STREAM_BLOCK_H = 1024  # H positions per program of the streaming kernels (one token per program)


def _ok(result):
    err = result[0] if isinstance(result, tuple) else result
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA runtime call failed: {err}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


class PersistingWindow:
    """The device's persisting L2 set-aside and the current stream's access policy window."""

    def __init__(self, device: torch.device):
        index = device.index or 0
        self.max_setaside = _ok(rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrMaxPersistingL2CacheSize,
                                                          index))
        self.max_window = _ok(rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrMaxAccessPolicyWindowSize,
                                                        index))
        self.setaside = 0

    def set_aside(self, nbytes: int):
        """``nbytes`` of L2 (at most the device's maximum) set aside for persisting lines."""
        _ok(rt.cudaDeviceSetLimit(rt.cudaLimit.cudaLimitPersistingL2CacheSize, min(nbytes, self.max_setaside)))
        self.setaside = _ok(rt.cudaDeviceGetLimit(rt.cudaLimit.cudaLimitPersistingL2CacheSize))

    def set(self, tensor: torch.Tensor | None):
        """The window over ``tensor`` (None: no window)."""
        window = rt.cudaAccessPolicyWindow()
        if tensor is not None:
            nbytes = min(tensor.numel() * tensor.element_size(), self.max_window)
            window.base_ptr = tensor.data_ptr()
            window.num_bytes = nbytes
            window.hitRatio = min(1.0, self.setaside / nbytes)
            window.hitProp = rt.cudaAccessProperty.cudaAccessPropertyPersisting
            window.missProp = rt.cudaAccessProperty.cudaAccessPropertyStreaming
        value = rt.cudaStreamAttrValue()
        value.accessPolicyWindow = window
        _ok(rt.cudaStreamSetAttribute(torch.cuda.current_stream().cuda_stream,
                                      rt.cudaStreamAttrID.cudaLaunchAttributeAccessPolicyWindow, value))

    def reset(self):
        """No window, and every persisting line back to normal."""
        self.set(None)
        _ok(rt.cudaCtxResetPersistingL2Cache())


def outputs_like(s: dict) -> MhcFusedHcDelayedOutput:
    """The op's fresh outputs for the set ``s`` (``problem.new_outputs``), given as its ``out=``."""
    return new_outputs(s["x_prev"], s["residual_prev"], s["post_mix_prev"], s["comb_mix_prev"], True,
                       s["x_prev"].shape[0])


def op_call(norm: bool, window: PersistingWindow | None):
    def call(s):
        if window is not None:
            window.set(s["out"].layer_input)
        args = {k: v for k, v in s.items() if k not in ("out", "scale")}  # "scale": the streaming kernels'
        mhc_fused_hc_delayed(**args | ({} if norm else {"norm_weight": None}), out=s["out"])
    return call


def stream_call(norm: bool, window: PersistingWindow | None):
    """The delayed seam's one pass (``rb._stream_kernel``), then with ``norm`` the in-place scaling of
    ``layer_input`` (``rb._scale_rows_kernel``), into the set's own output buffers."""
    def call(s):
        out, (m, h) = s["out"], s["x_prev"].shape
        if window is not None:
            window.set(out.layer_input)
        grid = (triton.cdiv(h, STREAM_BLOCK_H), m)
        rb._stream_kernel[grid](s["x_prev"], s["residual_prev"], s["pre_mix_prev"], out.residual_cur, out.layer_input,
                                h, BLOCK_H=STREAM_BLOCK_H, **rb.Stream(True, True, True)._asdict(), num_warps=4)
        if norm:
            rb._scale_rows_kernel[grid](out.layer_input, s["scale"], h, BLOCK_H=STREAM_BLOCK_H, num_warps=4)
    return call


def eager_us(call, sets, reps: int, batch: int = 4) -> float:
    """Median µs per call of ``batch`` passes over ``sets`` enqueued between two events."""
    for s in sets:
        call(s)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            for s in sets:
                call(s)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (batch * len(sets)))
    return statistics.median(times)


def timed(call, sets, reps: int, window: PersistingWindow, aside: bool) -> float:
    """``eager_us`` with the L2 set aside or not, from no persisting lines, and back to neither after."""
    window.set_aside(window.max_setaside if aside else 0)
    window.reset()
    try:
        return eager_us(call, sets, reps)
    finally:
        window.reset()
        window.set_aside(0)


def same_bits(s: dict, window: PersistingWindow) -> bool:
    """Whether the call with the norm writes the same outputs with the window as without it."""
    op_call(True, None)(s)
    before = type(s["out"])(*(t.clone() for t in s["out"]))
    window.set_aside(window.max_setaside)
    op_call(True, window)(s)
    window.reset()
    window.set_aside(0)
    return accuracy.same_bits(before, s["out"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 5120])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bw = mb.measure_copy_bandwidth(dev)
    window = PersistingWindow(dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}, copy bandwidth {bw / 1e12:.2f} TB/s, L2 "
          f"{torch.cuda.get_device_properties(dev).L2_cache_size / 2**20:.0f} MiB, persisting set-aside (where set) "
          f"{window.max_setaside / 2**20:.1f} MiB, largest window {window.max_window / 2**20:.0f} MiB", flush=True)
    # name: (make, norm, window, L2 set aside)
    rows = {}
    for aside in (False, True):
        tag = ", L2 set aside" if aside else ""
        rows.update({f"auto{tag}": (op_call, False, False, aside), f"auto norm{tag}": (op_call, True, False, aside),
                     f"stream{tag}": (stream_call, False, False, aside),
                     f"stream + norm pass{tag}": (stream_call, True, False, aside)})
    rows.update({"auto norm, li persisting": (op_call, True, True, True),
                 "stream + norm pass, li persisting": (stream_call, True, True, True)})
    try:
        with torch.no_grad():
            for h in args.hidden:
                for m in args.m:
                    sets = mb.with_carried_gates(mb.rotated_sets(m, h, dev, norm=True))
                    for s in sets:
                        s["out"] = outputs_like(s)
                        s["scale"] = torch.full((m,), 0.5, device=dev)
                    timers = {}
                    for name, (make, norm, persisting, aside) in rows.items():
                        call = make(norm, window if persisting else None)
                        timers[name] = (lambda call=call, aside=aside, sets=sets:
                                        timed(call, sets, args.reps, window, aside))
                    for name, make in (("auto", op_call), ("stream", stream_call)):
                        for norm in (False, True):
                            call = make(norm, None)
                            timers[f"{name}{' norm' if norm else ''}, graph"] = (
                                lambda call=call, sets=sets: mb.time_graph(call, sets))
                    same = same_bits(sets[0], window)
                    times = mb.alternating_rounds(timers, args.rounds)
                    floor_us = mb.delayed_floor_bytes(m, h) / bw * 1e6
                    print(f"PL H={h} M={m} {len(sets)} sets; outputs with the window as without it: {same}",
                          flush=True)
                    rb.print_rounds(f"PL H={h} M={m}", times, floor_us, 36)
                    del sets
    finally:
        window.reset()
        window.set_aside(0)


if __name__ == "__main__":
    main()
