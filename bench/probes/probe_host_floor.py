"""Where the host time of an eager call goes on this machine: the pieces of the floor (allocations, the compiled
call's TVM-FFI conversion and launches) and of the Python above it, each timed alone in a loop.

    python bench/probes/probe_host_floor.py [--m 1 32 256] [--hidden 7168] [--calls 25] [--loops 25 200 2000]
                                            [--profile]

Lines: ``PIECE name us`` (median of loops of ``--calls`` calls, 50 000 calls in all, under
``torch.inference_mode()``, the device synchronised between loops). ``LOOP`` lines: the eager ``auto`` call and its
floor (``benchmark.host_floor_call``) at each M timed with loops of each ``--loops`` length: where the kernels outlast
the host's work, a long loop fills the launch queue and then times the device (a per-call time that grows with the
loop's length says so). ``--profile``: a cProfile of eager calls at the first M, sorted by own time.
"""

import argparse
import cProfile
import functools
import pstats

import torch

from mhc_cute import api, benchmark as mb
from mhc_cute.api import mhc_fused_hc


def loop_us(fn, calls: int) -> float:
    return mb.host_us_per_call(lambda _s: fn(), None, calls=calls, rounds=max(5, 50_000 // calls))


def report_piece(name, fn, calls: int):
    print(f"PIECE {name:44s} {loop_us(fn, calls):7.2f}", flush=True)


def loop_lengths(m, h, dev, lengths):
    s = mb.make_sets(m, h, 1, dev, False)[0]
    eager, floor = (lambda: mhc_fused_hc(**s, backend="auto")), mb.host_floor_call(s)
    for calls in lengths:
        print(f"LOOP M={m:<6d} calls={calls:<6d} eager {loop_us(eager, calls):7.2f}  floor "
              f"{loop_us(lambda: floor(s), calls):7.2f}", flush=True)


def allocation_pieces(report, m, h, dev):
    bf, f32 = torch.bfloat16, torch.float32
    like_r, like_x = torch.empty(m, 4, h, dtype=bf, device=dev), torch.empty(m, h, dtype=bf, device=dev)
    like_c = torch.empty(m, 4, 4, device=dev)
    report("1 torch.empty bf16 [M,4,H]", lambda: torch.empty(m, 4, h, dtype=bf, device=dev))
    report("1 torch.empty tuple shape", lambda: torch.empty((m, 4, h), dtype=bf, device=dev))
    report("1 torch.empty_like", lambda: torch.empty_like(like_r))
    report("1 new_empty", lambda: like_r.new_empty((m, 4, h)))
    report("4 torch.empty (the floor's)", lambda: (
        torch.empty(m, 4, h, dtype=bf, device=dev), torch.empty(m, 4, 1, dtype=f32, device=dev),
        torch.empty(m, 4, 4, dtype=f32, device=dev), torch.empty(m, h, dtype=bf, device=dev)))
    report("4 empty_like/new_empty (the API's)", lambda: (
        torch.empty_like(like_r), like_c.new_empty((m, 4, 1)), torch.empty_like(like_c), torch.empty_like(like_x)))
    nb, nf = 5 * h, 24

    def two_buffers_views():
        b = torch.empty(m, nb, dtype=bf, device=dev)
        f = torch.empty(m, nf, dtype=f32, device=dev)
        return b[:, :4 * h].view(m, 4, h), f[:, :4].view(m, 4, 1), f[:, 4:20].view(m, 4, 4), b[:, 4 * h:]
    report("2 empty + 4 slices (strided rows)", two_buffers_views)

    def two_buffers_split():
        b = torch.empty(m * nb, dtype=bf, device=dev)
        f = torch.empty(m * nf, dtype=f32, device=dev)
        r, x = b.split_with_sizes((m * 4 * h, m * h))
        p, c, q = f.split_with_sizes((m * 4, m * 16, m * 4))
        return r.view(m, 4, h), p.view(m, 4, 1), c.view(m, 4, 4), x.view(m, h), q.view(m, 4)
    report("2 empty + split + 5 views (contiguous)", two_buffers_split)
    report("1 view", lambda: like_c.view(m, 16))
    report("1 as_strided", lambda: like_c.as_strided((m, 16), (16, 1)))


def misc_pieces(report, dev):
    one = torch.zeros(1, device=dev)
    report("torch add_ on 1 element (a launch)", lambda: one.add_(1))
    report("torch.cuda.current_stream()", torch.cuda.current_stream)
    report("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
    t = one
    report("t.shape,t.dtype,t.device,t.is_contiguous()", lambda: (t.shape, t.dtype, t.device, t.is_contiguous()))
    report("t.data_ptr()", t.data_ptr)
    try:
        import tvm_ffi
        nop = tvm_ffi.get_global_func("testing.nop", allow_missing=True)
        if nop is not None:
            ts = [torch.empty(16, device=dev) for _ in range(14)]
            report("tvm_ffi testing.nop()", nop)
            report("tvm_ffi testing.nop(14 tensors)", lambda: nop(*ts))
            ptrs = [x.data_ptr() for x in ts]
            report("tvm_ffi testing.nop(14 ints)", lambda: nop(*ptrs))
    except Exception as e:  # noqa: BLE001 (a probe: say what failed and go on)
        print("PIECE tvm_ffi nop unavailable:", type(e).__name__, e)


def call_pieces(report, m, h, dev):
    s = mb.make_sets(m, h, 1, dev, False)[0]
    full = lambda: mhc_fused_hc(**s, backend="auto")  # noqa: E731
    report(f"M={m} eager mhc_fused_hc auto", full)
    report(f"M={m} floor (benchmark.host_floor_call)", lambda f=mb.host_floor_call(s): f(s))
    tensors = (s["x_prev"], s["residual_prev"], s["post_mix_prev"], s["comb_mix_prev"], s["fn"], s["hc_scale"],
               s["hc_base"], None, None)
    scalars = (1e-6, 1e-6, 1e-6, 2.0, 20, 1e-6)
    plan = api._plan(tensors, scalars, "auto", "fp32", None, None, False)
    report(f"M={m} _plan (checks, key, lookup)", lambda: api._plan(tensors, scalars, "auto", "fp32", None, None,
                                                                     False))
    report(f"M={m} plan(tensors) (no key)", lambda: plan(tensors, None))
    launch = plan.launch
    if not hasattr(launch, "compiled"):  # not a CuTe path: nothing compiled to time alone
        return full
    flat = (*tensors[:2], s["post_mix_prev"].view(m, 4), *tensors[3:])
    outs = plan.run(tensors, None)
    report(f"M={m} launch(inputs, outs) (prepared)", lambda: launch(flat, outs))
    args = launch.arguments(flat, outs)
    report(f"M={m} launch.arguments", lambda: launch.arguments(flat, outs))
    compiled = launch.compiled
    report(f"M={m} compiled(*args) (no allocations)", lambda: compiled(*args))
    return full


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--calls", type=int, default=25, help="calls per timed loop of the pieces")
    ap.add_argument("--loops", type=int, nargs="*", default=[25, 200, 2000],
                    help="loop lengths of the LOOP lines (none: skip them)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    report = functools.partial(report_piece, calls=args.calls)
    dev = torch.device("cuda")
    import tvm_ffi
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, tvm_ffi {tvm_ffi.__version__}, "
          f"{mb.tvm_ffi_tensor_path()}")
    with torch.inference_mode():
        misc_pieces(report, dev)
        allocation_pieces(report, args.m[0], args.hidden, dev)
        fulls = [call_pieces(report, m, args.hidden, dev) for m in args.m]
        for m in args.m if args.loops else ():
            loop_lengths(m, args.hidden, dev, args.loops)
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(20000):
                fulls[0]()
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
