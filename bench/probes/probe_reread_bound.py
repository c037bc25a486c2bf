"""What the op's byte pattern allows at large M, measured with kernels that do nothing but move those bytes.

Every two-kernel design (path B, path E, Triton; path D's last-CTA collapse too, unless the tile's rows are still in
L2) writes ``residual_cur`` and reads it back for the collapse: 28 H bytes per token against the floor's 20 H. This
probe times plain Triton streaming kernels with that traffic, no projection and no mixes, so what they reach is a
ceiling for any such design on this GPU:

- ``post``: per token ``residual_cur[j] = bf16(x + residual_prev[j])`` (reads 10 H bytes, writes 8 H);
- ``collapse``: ``layer_input = bf16(sum_j residual_cur[j])`` (reads 8 H, writes 2 H);
- ``two-pass``: both, one after the other over all M tokens (the re-read from HBM);
- ``two-pass/chunk C``: both per chunk of C tokens, so that the re-read may come from L2 (one launch pair per chunk);
- ``one-pass``: post and collapse in one kernel from registers, the floor's 20 H (what a design holding the rows on
  chip would move).

``--delayed``: the byte pattern of V4.1's delayed seam (``mhc_fused_hc_delayed``), whose collapse takes the carried
gates, so one pass moves its 20 H; the fused norm then needs the row's sum of squares, known only once the whole row
is collapsed, so every design that does not hold whole rows on chip re-reads and rewrites ``layer_input`` (4 H more):

- ``delayed one-pass``: ``residual_cur[j] = bf16(x + residual_prev[j])``, ``layer_input = bf16(sum_j pre[j]
  residual_cur[j])`` (reads 10 H, writes 10 H);
- ``norm pass``: ``layer_input *= scale`` per token, in place (reads 2 H, writes 2 H);
- ``delayed one-pass + norm``: both over all M tokens; ``/chunk C``: both per chunk of C tokens (the re-read may
  come from L2, a bound for a design that normalises each row soon after writing it);
- ``..., li last``: ``layer_input`` stored with the L2 evict-last hint and re-read with evict-first, so that it may
  stay in L2 while the inputs stream past (``loads plain``: the inputs loaded without the evict-first hint, as kernel
  1's TMA loads are);
- the op's ``auto`` without and with the norm.

Fractions are then of the delayed seam's floor (``benchmark.delayed_floor_bytes``, without the norm's re-read).

Each at several block widths (the best reported), CUDA-graph replay over rotated inputs, median; the whole op's
``auto`` and ``half_mma`` (and TileKernels when staged) timed on the same sets in the same process. Fractions are of
SPEC's floor (``benchmark.floor_bytes``) at the copy bandwidth B measured in the run, as in the benchmark.

    python bench/probes/probe_reread_bound.py --hidden 7168 4096 --m 2048 8192
    python bench/probes/probe_reread_bound.py --delayed --hidden 7168 5120 --m 2048 8192

Lines: ``RB H M name us floor%``.
"""

import argparse
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402

BLOCKS_H = (512, 1024, 2048)  # H positions per program (one token per program; pieces of 1-4 KB per stream)


@triton.jit
def _stream_kernel(x_ptr, res_ptr, pre_ptr, res_out_ptr, li_ptr, H, BLOCK_H: tl.constexpr,
                   POST: tl.constexpr, COLLAPSE: tl.constexpr, CARRIED: tl.constexpr = False,
                   LI_LAST: tl.constexpr = False, LOAD_FIRST: tl.constexpr = True):
    """``CARRIED``: the collapse weighs stream j with ``pre[row, j]`` (the delayed seam's carried gates). ``LI_LAST``:
    ``layer_input`` stored with the L2 evict-last hint; ``LOAD_FIRST``: the inputs loaded with evict-first (else
    with no hint, as kernel 1's TMA loads)."""
    LOAD_POLICY: tl.constexpr = "evict_first" if LOAD_FIRST else ""
    LI_POLICY: tl.constexpr = "evict_last" if LI_LAST else ""
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < H
    if POST:
        x = tl.load(x_ptr + row * H + h, mask=mask, eviction_policy=LOAD_POLICY).to(tl.float32)
    if POST:
        src = res_ptr
    else:
        src = res_out_ptr
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(4):
        r = tl.load(src + row * 4 * H + j * H + h, mask=mask, eviction_policy=LOAD_POLICY)
        if POST:
            r = (x + r.to(tl.float32)).to(tl.bfloat16)
            tl.store(res_out_ptr + row * 4 * H + j * H + h, r, mask=mask)
        if CARRIED:
            acc += tl.load(pre_ptr + row * 4 + j) * r.to(tl.float32)
        else:
            acc += r.to(tl.float32)
    if COLLAPSE:
        tl.store(li_ptr + row * H + h, acc.to(tl.bfloat16), mask=mask, eviction_policy=LI_POLICY)


@triton.jit
def _scale_rows_kernel(li_ptr, scale_ptr, H, BLOCK_H: tl.constexpr, LOAD_FIRST: tl.constexpr = False):
    LOAD_POLICY: tl.constexpr = "evict_first" if LOAD_FIRST else ""
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < H
    v = tl.load(li_ptr + row * H + h, mask=mask, eviction_policy=LOAD_POLICY).to(tl.float32)
    tl.store(li_ptr + row * H + h, (v * tl.load(scale_ptr + row)).to(tl.bfloat16), mask=mask)


class Stream(NamedTuple):
    """One launch of ``_stream_kernel``: its constexpr flags."""
    POST: bool
    COLLAPSE: bool
    CARRIED: bool = False
    LI_LAST: bool = False
    LOAD_FIRST: bool = True


# each kind's launches per chunk of tokens: a ``Stream``, or "scale" (the norm pass; "scale first": its loads
# evict-first)
PASSES = {"post": [Stream(True, False)], "collapse": [Stream(False, True)],
          "two-pass": [Stream(True, False), Stream(False, True)], "one-pass": [Stream(True, True)],
          "delayed one-pass": [Stream(True, True, True)], "norm pass": ["scale"],
          "delayed one-pass + norm": [Stream(True, True, True), "scale"],
          # the re-read from L2: layer_input stored evict-last, the inputs evict-first (or without a hint)
          "delayed one-pass + norm, li last": [Stream(True, True, True, LI_LAST=True), "scale first"],
          "delayed one-pass + norm, li last, loads plain": [Stream(True, True, True, True, False), "scale first"],
          "delayed one-pass + norm, loads plain": [Stream(True, True, True, LOAD_FIRST=False), "scale"]}


def stream_call(kind: str, m: int, h: int, block_h: int, chunk: int, dev):
    """A call moving the bytes of ``kind`` (``PASSES``) for all M tokens, ``chunk`` tokens per launch (group); its
    outputs stay in ``call.residual_cur`` and ``call.layer_input``."""
    res_out = torch.empty(m, 4, h, dtype=torch.bfloat16, device=dev)
    li = torch.zeros(m, h, dtype=torch.bfloat16, device=dev)
    scale = torch.full((m,), 0.5, device=dev)

    def call(s):
        # "collapse" reads what the sets' residual_prev holds, as a residual_cur of the same size; without carried
        # gates x stands in for the unread pre pointer
        srcs = (s["x_prev"], s["residual_prev"], s.get("pre_mix_prev", s["x_prev"]),
                s["residual_prev"] if kind == "collapse" else res_out, li, scale)
        for start in range(0, m, chunk):
            rows = min(chunk, m - start)
            x, r, pre, ro, out, sc = (t[start:start + rows] for t in srcs)
            grid = (triton.cdiv(h, block_h), rows)
            for launch in PASSES[kind]:
                if launch in ("scale", "scale first"):
                    _scale_rows_kernel[grid](out, sc, h, BLOCK_H=block_h, LOAD_FIRST=launch == "scale first",
                                             num_warps=4)
                else:
                    _stream_kernel[grid](x, r, pre, ro, out, h, BLOCK_H=block_h, **launch._asdict(), num_warps=4)
    call.residual_cur, call.layer_input = res_out, li
    return call


def best_us(kind, chunk, m, h, sets, dev):
    return min(mb.time_graph(stream_call(kind, m, h, bh, chunk, dev), sets) for bh in BLOCKS_H if bh <= h)


def delayed_rows(m: int, chunks) -> dict:
    rows = {f"stream {k}": (k, m) for k in ("delayed one-pass", "norm pass", "delayed one-pass + norm",
                                             "delayed one-pass + norm, li last",
                                             "delayed one-pass + norm, li last, loads plain",
                                             "delayed one-pass + norm, loads plain")}
    rows.update({f"stream delayed one-pass + norm/chunk {c}": ("delayed one-pass + norm", c) for c in chunks if c < m})
    return rows


def delayed_op_calls(backends) -> dict:
    """The delayed seam's calls on ``backends``, without and with the norm (the sets carry a norm weight)."""
    calls = {}
    for b in backends:
        op = mb.mhc_cute_call(b, delayed=True)
        calls[f"op {b}"] = (lambda s, op=op: op(dict(s, norm_weight=None)))
        calls[f"op {b} norm"] = op
    return calls


def print_rounds(prefix: str, times: dict, floor_us: float, width: int):
    """One line per ``alternating_rounds`` row: its median µs and fraction of the floor, and each round's µs (or
    the row's error)."""
    for name, ts in times.items():
        if isinstance(ts, Exception):
            print(f"{prefix} {name:<{width}} ERROR {type(ts).__name__} {str(ts)[:160]}", flush=True)
            continue
        us = statistics.median(ts)
        print(f"{prefix} {name:<{width}} {us:9.1f} us  {100 * floor_us / us:5.1f}% of the floor"
              f"  (rounds {' '.join(f'{t:.1f}' for t in ts)})", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    ap.add_argument("--chunks", type=int, nargs="*", default=[128, 256, 512, 1024])
    ap.add_argument("--backends", nargs="*", default=["auto", "half_mma"])
    ap.add_argument("--rounds", type=int, default=2, help="rounds over every row (median reported)")
    ap.add_argument("--delayed", action="store_true", help="the delayed seam's byte pattern (module docstring)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bw = mb.measure_copy_bandwidth(dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}, copy bandwidth {bw / 1e12:.2f} TB/s")
    peers = {} if args.delayed else {k: v for k, v in mb.peer_calls(norm=False).items() if k == "tilekernels"}
    with torch.no_grad():
        for h in args.hidden:
            for m in args.m:
                if args.delayed:
                    sets = mb.with_carried_gates(mb.rotated_sets(m, h, dev, norm=True))
                    rows, calls = delayed_rows(m, args.chunks), delayed_op_calls(args.backends)
                else:
                    sets = mb.rotated_sets(m, h, dev)
                    rows = {f"stream {k}": (k, m) for k in ("post", "collapse", "two-pass", "one-pass")}
                    rows.update({f"stream two-pass/chunk {c}": ("two-pass", c) for c in args.chunks if c < m})
                    calls = {f"op {b}": mb.mhc_cute_call(b) for b in args.backends}
                calls.update({f"op {k}": v for k, v in peers.items()})
                timers = {name: (lambda r=r, sets=sets: best_us(*r, m, h, sets, dev)) for name, r in rows.items()}
                timers.update({name: (lambda c=c, sets=sets: mb.time_graph(c, sets)) for name, c in calls.items()})
                times = mb.alternating_rounds(timers, args.rounds)
                floor_us = (mb.delayed_floor_bytes if args.delayed else mb.floor_bytes)(m, h) / bw * 1e6
                print_rounds(f"RB H={h} M={m}", times, floor_us, 28)
                del sets


if __name__ == "__main__":
    main()
