"""The ``mhc-cute`` command: ``info``, ``check``, ``bench``, ``tune``, ``precompile``."""

from __future__ import annotations

import argparse
import os
import platform
import sys

# CuTe DSL must target Hopper even when it cannot see a GPU; read at `import cutlass`.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

DEEPSEEK_HIDDEN = (4096, 5120, 7168)  # V4-Flash, V4.1, V4-Pro (SPEC)
DEEPSEEK_SHAPES = [(1, 7168), (17, 7168), (256, 4096), (1000, 5120)]
TUNE_MEASURES = ("contexts", "back-to-back")  # autotune.MEASURES, without importing torch to parse arguments
# every op of a forward pass (autotune.SEAM_VARIANTS' seams, and the standalone kernels of mhc_post and mhc_collapse)
PRECOMPILE_OPS = ("mhc_fused_hc", "mhc_fused_hc_delayed", "mhc_head", "mhc_post", "mhc_collapse")


def cmd_info(args) -> int:
    import torch

    from . import __version__, backends
    from .benchmark import tvm_ffi_tensor_path
    from .version import dist_version

    print(f"mhc_cute {__version__}; python {platform.python_version()}; torch {torch.__version__}")
    for dist in ("nvidia-cutlass-dsl", "cuda-python", "apache-tvm-ffi", "triton"):
        print(f"  {dist}: {dist_version(dist)}")
    print(f"  TVM-FFI passes torch tensors via: {tvm_ffi_tensor_path()}")
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        p = torch.cuda.get_device_properties(dev)
        print(f"GPU: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
              f"{p.total_memory / 2**30:.0f} GiB ({'ROCm' if torch.version.hip else 'CUDA'})")
    else:
        dev = torch.device("cpu")
        print("GPU: none")
    for name, b in backends.BACKENDS.items():
        why = backends.unavailable_reason(name, dev)
        print(f"  {name:9s} {'available' if why is None else 'unavailable: ' + why:40s} {b.summary}")
    if dev.type == "cuda" and torch.version.hip is None:
        from . import selector

        print(f"auto's tuned tables (user cache: {selector.cache_path()}):")
        for seam in selector.SEAMS:
            for hidden in DEEPSEEK_HIDDEN:
                for norm in (False, True):
                    key = selector.SELECTOR.table_key(dev, hidden, "fp32", norm, seam)
                    how = ("none: the heuristic" if key is None else key if selector.TuneKey.parse(key).gpu == p.name
                           else f"{key} (a stand-in: same compute capability and SM count)")
                    print(f"  {seam} seam H={hidden} fp32 norm={int(norm)}: {how}")
    return 0


def cmd_check(args) -> int:
    import torch

    from . import backends
    from .accuracy import check_backend, make_inputs, problem_of

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = args.backends or backends.available(dev)
    shapes = DEEPSEEK_SHAPES if dev.type == "cuda" else [(1, 256), (5, 512)]
    print(f"device: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}; "
          "errors vs float64 (residual_cur bitwise vs the fp32 FMA chain)")
    print(f"{'backend':9s} {'M':>5} {'H':>5} {'norm':>4}  {'post_mix':>9} {'comb_mix':>9} {'li ulps':>7}  result")
    failures = 0
    for name in names:
        for m, h in shapes:
            for norm in (False, True):
                problem = problem_of(make_inputs(m, h, device=dev, norm=norm, seed=m + h))
                try:
                    errs = check_backend(problem, name)
                    row = f"{errs['post_mix']:9.1e} {errs['comb_mix']:9.1e} {errs['layer_input_max_ulps']:7.2f}  PASS"
                except Exception as e:  # a failing backend is a row in the table
                    failures += 1
                    row = f"{'':9s} {'':9s} {'':7s}  FAIL: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
                print(f"{name:9s} {m:5d} {h:5d} {str(norm):>4}  {row}", flush=True)
    print(f"{'all passed' if failures == 0 else f'{failures} failed'}")
    return 1 if failures else 0


def cmd_bench(args) -> int:
    import torch

    from . import backends, benchmark as bm

    if args.form and (args.op or args.model):
        print("mhc-cute bench: --form times a seam; it does not go with --op or --model", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("mhc-cute bench needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    if args.host:
        return bench_host(args, dev, gpu)
    ms = args.m or bm.BENCH_MS
    hiddens = args.hidden or [4096, 7168]
    bandwidth = bm.measure_copy_bandwidth(dev)
    if args.model:
        return _bench_model(args, bm, ms, dev, gpu, bandwidth)
    if args.op:  # a standalone op, with mhc_fused_hc's auto as the comparison column; no peers
        from . import ops

        names = args.backends or [n for n in ops.available(args.op, dev) if n != "torch"]
        calls = bm.op_calls(args.op, [n for n in names if n != "auto"])
    elif args.form:  # a seam in an entry form, with mhc_fused_hc's auto as the comparison column; no peers
        names = args.backends or [n for n in backends.available(dev) if n != "torch"]
        calls = bm.form_calls([n for n in names if n != "auto"], args.delayed, args.precision)
    elif args.delayed:  # the delayed seam, with mhc_fused_hc's auto as the comparison column; no peers
        names = args.backends or [n for n in backends.available(dev) if n != "torch"]
        calls = bm.delayed_calls([n for n in names if n != "auto"], args.precision)
    else:
        names = args.backends or [n for n in backends.available(dev) if n != "torch"]
        calls = {"auto": bm.mhc_cute_call("auto", args.precision)} if "auto" not in names else {}
        calls.update({n: bm.mhc_cute_call(n, args.precision) for n in names})
        if not args.no_peers:
            calls.update(bm.peer_calls(args.norm))
    floor = (bm.OP_FLOORS[args.op.removeprefix("mhc_")] if args.op else bm.FORM_FLOORS[args.form] if args.form
             else bm.delayed_floor_bytes if args.delayed else bm.floor_bytes)
    apart = args.delayed or args.op or args.form  # not mhc_fused_hc's regular seam: no contexts, no host times
    results = []
    for h in hiddens:
        for m in ms:
            sets = bm.rotated_sets(m, h, dev, args.norm)
            if args.delayed or args.op:
                sets = bm.with_carried_gates(sets)
            contexts = (bm.context_predecessors(sets) if m <= bm.CONTEXT_MAX_M and not (args.op or args.form)
                        else None)
            if args.op:
                sets = bm.op_sets(args.op, sets)
            if args.form:
                sets = bm.form_sets(args.form, sets)
            for name, call in calls.items():
                eager = not (name == "torch-compile" and m > 4096)
                results.append(bm.bench_one(name, call, m, h, dev, args.norm, bandwidth, sets=sets, eager=eager,
                                            contexts=contexts, floor=floor))
                r = results[-1]
                if name == "auto" and not apart and m <= bm.HOST_MAX_M and r.error is None:
                    r.host = bm.host_times(m, h, dev, args.norm, args.precision)._asdict()
                print(f"  H={h} M={m} {name}: {r.graph_us if r.error is None else r.error}", file=sys.stderr,
                      flush=True)
            del sets
            torch.cuda.empty_cache()
            if args.json:  # after every shape, so that a run cut short keeps what it measured
                bm.write_json(results, args.json, bandwidth, gpu,
                              dict(norm=args.norm, precision=args.precision, delayed=args.delayed, op=args.op,
                                   form=args.form))
    print(bm.format_table(results, bandwidth, gpu))
    print(bm.auto_summary(results, names))
    if args.plot:
        bm.plot(results, args.plot, gpu)
    return 0


def _bench_model(args, bm, ms, dev, gpu, bandwidth) -> int:
    """``bench --model``: the mHC time of one forward pass per M, beside TileKernels' (V4) and the torch reference."""
    import json

    def log(r):
        print(f"  {r.model} M={r.m} {r.name}: {r.ms if r.error is None else r.error}", file=sys.stderr, flush=True)

    results = bm.bench_model(args.model, ms, dev, bandwidth, names=args.backends, log=log)
    print(bm.format_model_table(results, bandwidth, gpu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, bandwidth=bandwidth, model=args.model, config=bm.MODELS[args.model]._asdict(),
                           results=[r._asdict() for r in results]), f, indent=1)
    return 0


def bench_host(args, dev, gpu: str) -> int:
    """``mhc-cute bench --host``: only the host time per eager call of auto beside its floor (about a minute)."""
    import torch

    from . import benchmark as bm

    rows = []
    for h in args.hidden or [7168]:
        for m in args.m or bm.HOST_MS:
            if args.op:
                rows.append((h, m, bm.op_host_times(args.op, m, h, dev)))
            else:
                rows.append((h, m, bm.host_times(m, h, dev, args.norm, args.precision, compiled=args.compile,
                                                 delayed=args.delayed)))
            print(f"  H={h} M={m}: {rows[-1]}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
    op = args.op or ("mhc_fused_hc_delayed" if args.delayed else "mhc_fused_hc")
    print(bm.format_host_table(rows, gpu, op))
    if args.json:
        results = [bm.Result("auto", m, h, host=t._asdict()) for h, m, t in rows]
        bm.write_json(results, args.json, None, gpu, dict(norm=args.norm, precision=args.precision, host_only=True,
                                                          op=op))
    return 0


def cmd_tune(args) -> int:
    import torch

    from . import autotune, backends, benchmark as bm, selector

    if not torch.cuda.is_available():
        print("mhc-cute tune needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    names = args.backends or [n for n in backends.available(dev) if n != "torch"]
    tables = autotune.tune(dev, args.hidden, args.m, args.precision, args.norm, names, measure=args.measure,
                           seam="delayed" if args.delayed else "v4")
    path = selector.save_user_tables(tables, args.out)
    selector.SELECTOR.reload()
    if args.measure == "contexts":
        print(f"us: up to M = {bm.CONTEXT_MAX_M} the worst of back to back, after a non-PDL kernel and after a "
              "cuBLAS GEMM; above it back to back (CUDA-graph replay)")
    for key, rows in tables.items():
        print(key)
        for b, c in sorted(rows.items()):
            print(f"  M<={b:6d}  {c.backend:9s} {c.tactic or '(default)':32s} {c.us:8.2f} us")
    print(f"written to {path}")
    return 0


def cmd_precompile(args) -> int:
    import time

    import torch

    from . import autotune
    from .kernels import KERNEL_CACHE_ENV

    folder = args.cache or os.environ.get(KERNEL_CACHE_ENV)
    if not folder:
        print(f"mhc-cute precompile: give --cache DIR or set {KERNEL_CACHE_ENV} (the folder later processes load "
              "the kernels from)", file=sys.stderr)
        return 2
    sm_count = args.sm_count
    if sm_count is None:
        if not torch.cuda.is_available() or torch.version.hip is not None:
            print("mhc-cute precompile: no NVIDIA GPU here: give --sm-count (the target GPU's, e.g. 132 for an "
                  "H100/H200 SXM)", file=sys.stderr)
            return 2
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    os.environ[KERNEL_CACHE_ENV] = folder
    t0 = time.perf_counter()
    variants = [v for op in args.ops for v in autotune.SEAM_VARIANTS.get(op, ())]
    norms = [None if norm == "none" else norm for norm in args.norm]
    n = 0
    if variants:
        for precision in args.precision:
            candidates = [c for h in args.hidden for c in autotune.auto_candidates(h, args.max_m, precision, sm_count)]
            for norm in norms:
                n += autotune.precompile_candidates(candidates, precision, norm, variants)
    if "mhc_post" in args.ops:
        from .kernels import post

        n += len(post.precompile(args.hidden))
    if "mhc_collapse" in args.ops:
        from .kernels import collapse

        n += len(collapse.precompile([(h, norm) for h in args.hidden for norm in norms]))
    print(f"{n} CuTe kernel variants ready in {folder} ({time.perf_counter() - t0:.0f} s; {', '.join(args.ops)}; "
          f"H = {', '.join(map(str, args.hidden))}; M <= {args.max_m}; {sm_count} SMs; norm weight "
          f"{' / '.join(args.norm)}; {' / '.join(args.precision)}): with {KERNEL_CACHE_ENV}={folder}, a process loads "
          "each in about a millisecond instead of compiling it (seconds)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mhc-cute", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, GPU, available backends").set_defaults(fn=cmd_info)
    c = sub.add_parser("check", help="every available backend vs the float64 reference on DeepSeek-V4 shapes")
    c.add_argument("--backends", nargs="*")
    c.set_defaults(fn=cmd_check)
    b = sub.add_parser("bench", help="time the auto choice, every backend and the peers")
    b.add_argument("--hidden", type=int, nargs="+", help="default: 4096 7168 (with --host: 7168)")
    b.add_argument("--m", type=int, nargs="+",
                   help="default: benchmark.BENCH_MS (1, 2, 4, ..., 16384); with --host: 1 32 256")
    b.add_argument("--backends", nargs="*", help="default: every available kernel backend")
    b.add_argument("--precision", default="fp32", choices=["fp32", "tf32"])
    b.add_argument("--norm", action="store_true", help="fuse the next sublayer's RMSNorm (peers without it drop out)")
    b.add_argument("--no-peers", action="store_true")
    b.add_argument("--delayed", action="store_true",
                   help="time V4.1's delayed seam (mhc_fused_hc_delayed; floor (20H + 192) M + 384H bytes) against "
                        "mhc_fused_hc's auto on the same inputs")
    b.add_argument("--op", choices=["mhc_post", "mhc_collapse", "mhc_head"],
                   help="time a standalone op (floor from SPEC's cost model) against mhc_fused_hc's auto on the "
                        "same tokens")
    b.add_argument("--form", choices=["no_post", "broadcast"],  # problem.FORMS' entry forms (no torch import here)
                   help="time the seam (with --delayed: the delayed seam) in an entry form (floor from SPEC's cost "
                        "model) against mhc_fused_hc's auto on the regular seam's inputs")
    b.add_argument("--json", help="write the results here")
    b.add_argument("--model", choices=["v4-pro", "v4-flash", "v4.1-flash"],
                   help="time one forward pass's mHC ops instead (--backends: of auto, torch, tilekernels)")
    b.add_argument("--plot", help="write a PNG plot (time vs M) here")
    b.add_argument("--host", action="store_true",
                   help="only the host time per eager call of auto beside its floor (4 torch.empty + the kernels' "
                        "TVM-FFI call with prepared arguments), at H = 7168 and M = 1, 32, 256 by default; with "
                        "--delayed of mhc_fused_hc_delayed, with --op of that standalone op")
    b.add_argument("--compile", action="store_true",
                   help="with --host: also the host time per call through torch.compile (inductor, no CUDA graphs)")
    b.set_defaults(fn=cmd_bench)
    t = sub.add_parser("tune", help="time every valid tactic per M bucket and cache the winners")
    t.add_argument("--hidden", type=int, nargs="+", default=list(DEEPSEEK_HIDDEN))
    t.add_argument("--m", type=int, nargs="+", default=None, help="default: one M per bucket up to 16384")
    t.add_argument("--backends", nargs="*")
    t.add_argument("--precision", default="fp32", choices=["fp32", "tf32"])
    t.add_argument("--norm", action="store_true")
    t.add_argument("--measure", default="contexts", choices=TUNE_MEASURES,
                   help="rank by the worst of back to back and after the kernels a call follows in a model "
                        "(contexts, the default; up to M = 128) or by back-to-back graph time alone")
    t.add_argument("--delayed", action="store_true",
                   help="tune mhc_fused_hc_delayed (carried gates) into tables of its own (auto of the delayed seam "
                        "takes them before the V4 seam's)")
    t.add_argument("--out", help="cache file (default: the user cache, see mhc_cute.selector)")
    t.set_defaults(fn=cmd_tune)
    pc = sub.add_parser("precompile", help="compile ahead every CuTe kernel auto may run, into a kernel cache folder")
    pc.add_argument("--hidden", type=int, nargs="+", required=True)
    pc.add_argument("--max-m", type=int, default=16384, help="the most tokens per call (default 16384)")
    pc.add_argument("--norm", nargs="+", default=["none", "bfloat16"], choices=["none", "bfloat16", "float32"],
                    help="the fused norm weight's dtype, or none (default: none bfloat16)")
    pc.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "tf32"])
    pc.add_argument("--sm-count", type=int, help="the target GPU's SM count (default: this machine's GPU)")
    pc.add_argument("--cache", help="the folder (default: $MHC_CUTE_KERNEL_CACHE)")
    pc.add_argument("--ops", nargs="+", default=list(PRECOMPILE_OPS), choices=PRECOMPILE_OPS,
                    help="the ops whose kernels to compile, each in every form auto may run (default: all)")
    pc.set_defaults(fn=cmd_precompile)
    args = p.parse_args(argv)
    if args.cmd == "bench" and args.compile and (not args.host or args.op):
        p.error("--compile goes with --host, for the seams")
    if args.cmd == "tune" and args.m is None:
        from .selector import all_buckets

        args.m = all_buckets(16384)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
