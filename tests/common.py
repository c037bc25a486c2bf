"""Test helpers: the package's accuracy contract (mhc_cute.accuracy), re-exported for the test modules."""

from mhc_cute.accuracy import (  # noqa: F401
    bf16_ulp,
    check_outputs,
    make_inputs,
    near_bf16_midpoint,
    normwise,
    poisoned_outputs,
    problem_of,
    run_backend,
)
