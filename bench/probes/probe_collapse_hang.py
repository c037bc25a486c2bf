"""Where does the CuTe ``mhc_collapse`` with ``norm_weight`` hang? (H200, 2026-12-04: the GPU tests, the sanitizer
sweep and the soak all stopped in it; without the norm it runs.) Answer: the CTA reduction, where ``warp_idx()``, a
whole-warp shuffle, ran under the lane-0 test (fixed in fa66543; ``docs/experiments.md``).

Each variant runs in a child process that prints every step it reaches (compile, launch, synchronize, check) and,
past ``--timeout`` seconds, every thread's Python stack (``faulthandler``); the parent prints one line per variant:
the last step reached and how the child ended. Variants:

- ``cached``: the shipped path, ``kernels.collapse.run_collapse`` through ``$MHC_CUTE_KERNEL_CACHE`` (export, load);
- ``inline``: the shipped kernel compiled in the process (no object file);
- ``no-pdl``: launched without programmatic dependent launch (and no ``griddepcontrol``);
- ``no-prefetch``: the norm weight read in the second pass instead of before ``griddepcontrol.wait``;
- ``no-reduce``: no CTA reduction (each warp normalises by its own sum: wrong values, the same memory traffic);
- ``no-norm``: the kernel without the norm (ran before).

    python bench/probes/probe_collapse_hang.py --m 3 --hidden 7168 --norm bfloat16
"""

import argparse
import faulthandler
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("no-norm", "inline", "cached", "no-pdl", "no-prefetch", "no-reduce")


def step(name: str) -> None:
    print(f"step {name} {time.monotonic():.3f}", flush=True)


def probe_kernel_class():
    """``CollapseKernel`` with the variants' toggles: its kernel body as shipped, the launch without PDL
    (``pdl=False``), the norm weight read in the second pass (``prefetch=False``: the phase's own switch), each warp
    normalising by its own sum (``reduce=False``: the phase's CTA reduction replaced on this instance)."""
    import cutlass.cute as cute
    from cutlass import Float32

    from mhc_cute.kernels import device_utils as du
    from mhc_cute.kernels.collapse import CollapseKernel
    from mhc_cute.tactics import HC_MULT

    class ProbeCollapse(CollapseKernel):
        def __init__(self, hidden, norm_dtype, pdl=True, prefetch=True, reduce=True):
            super().__init__(hidden, norm_dtype)
            self.pdl = pdl
            self.phase.prefetch_norm = self.phase.prefetch_norm and prefetch
            if not reduce:
                self.phase.group_sum = lambda val, scratch, group: du.warp_sum(val)

        @cute.jit
        def __call__(self, residual: cute.Tensor, pre_mix: cute.Tensor, norm_weight, out: cute.Tensor,
                     norm_eps: Float32, stream):
            # the shipped launch but for ``use_pdl`` (the kernel's griddepcontrol instructions do nothing without it)
            m = residual.shape[0]
            self.kernel(cute.make_tensor(residual.iterator, du.row_major(m, HC_MULT * self.hidden)),
                        cute.make_tensor(pre_mix.iterator, du.row_major(m, HC_MULT)), norm_weight,
                        cute.make_tensor(out.iterator, du.row_major(m, self.hidden)), norm_eps).launch(
                grid=[m, 1, 1], block=[self.phase.threads, 1, 1], stream=stream, use_pdl=self.pdl)

    return ProbeCollapse


def child(variant: str, m: int, hidden: int, norm: str, timeout: float) -> int:
    faulthandler.dump_traceback_later(timeout, exit=True, file=sys.stdout)
    step("import")
    import torch

    from mhc_cute.accuracy import check_op_output, make_op_inputs
    from mhc_cute.kernels import collapse, compile_kernel, cute_dtype, fake_tensors

    torch.cuda.init()
    inputs = make_op_inputs("mhc_collapse", m, hidden, seed=1, norm=variant != "no-norm", device="cuda")
    if variant != "no-norm" and norm == "float32":
        inputs["norm_weight"] = inputs["norm_weight"].float()
    residual, pre_mix, norm_weight = inputs["residual"], inputs["pre_mix"].reshape(m, 4), inputs.get("norm_weight")
    out = torch.empty(m, hidden, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    step("inputs")
    if variant == "cached":
        os.environ.setdefault("MHC_CUTE_KERNEL_CACHE", "/tmp/mhc-kcache-probe")
        fn = collapse.compiled_collapse(residual, pre_mix, norm_weight, out)
    else:
        import cutlass.cute as cute
        from cutlass import Float32

        toggles = {"no-pdl": dict(pdl=False), "no-prefetch": dict(prefetch=False), "no-reduce": dict(reduce=False)}
        kernel = probe_kernel_class()(hidden, None if norm_weight is None else cute_dtype(norm_weight.dtype),
                                      **toggles.get(variant, {}))
        fakes = fake_tensors(residual, pre_mix, out, tokens=cute.sym_int())
        fn = compile_kernel(kernel, fakes[0], fakes[1], *fake_tensors(norm_weight), fakes[2], Float32(0.0))
    step("compiled")
    fn(residual, pre_mix, norm_weight, out, 1e-6)
    step("launched")
    torch.cuda.synchronize()
    step("synchronized")
    if variant in ("no-norm", "inline", "cached", "no-pdl", "no-prefetch"):
        try:
            check_op_output("mhc_collapse", out, inputs, norm_eps=1e-6)
            step("checked")
        except AssertionError as e:
            print(f"check failed: {str(e).splitlines()[0]}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--norm", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=30, help="seconds per variant before its stacks are printed")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.child:
        return child(args.child, args.m, args.hidden, args.norm, args.timeout)
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", variant, "--m", str(args.m), "--hidden", str(args.hidden),
               "--norm", args.norm, "--timeout", str(args.timeout)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 30)
            text, how = proc.stdout + proc.stderr, f"exit {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            text, how = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "killed"
        steps = [line.split()[1] for line in text.splitlines() if line.startswith("step ")]
        timed_out = "Timeout (" in text
        print(f"{variant:12s} M={args.m} H={args.hidden} norm={args.norm}: last step {steps[-1] if steps else '-'}, "
              f"{'TIMED OUT' if timed_out else how}", flush=True)
        if timed_out or how != "exit 0":
            print("    " + "\n    ".join(text.strip().splitlines()[-25:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
