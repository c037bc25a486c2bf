"""The offline tuner behind ``mhc-cute tune`` and ``mhc-cute precompile``: the candidate tactics per M bucket,
their timing (``benchmark``) and float64 checks (``accuracy``), and the kernels ``auto`` may run. It writes the tables
that ``selector`` reads at run time.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from dataclasses import replace

import torch

from . import accuracy, benchmark as bm, tactics
from .kernels import KERNEL_CACHE_ENV
from .problem import FORMS
from .selector import (
    SEAMS, Choice, TuneKey, all_buckets, bucket_of, load_shipped_tables, load_user_tables, nearest, tactic_or_none,
)


def progress(i: int, n: int, label: str) -> None:
    width = 30
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:60]:60s}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def candidate_tactics(backend: str, m: int, hidden: int, sm_count: int) -> list:
    """What the tuner times for ``backend`` at M = ``m``: its default tactic (the first) and its neighbours in the
    big-fuse shape (two-launch paths); for the tensor-core paths each M tile's default split_k, half of it, double
    and four times it, each at the three deepest pipelines that fit (``tactics.mma_shapes``); for the
    FMA paths the FFMA-projection tactic (``tactics.ffma_tactic``, the default itself outside 9 <= M <= 128) and its
    neighbours in split_k, tokens per CTA, big-fuse shape and the weight pipeline with wider post-map steps (where a
    CTA walks several chunks), and from M = 8 the projection on warp MMA (16 or 32 tokens per CTA, one chunk per
    CTA, each big-fuse shape; 256 threads, or 128 with the FFMA tactic's chunk or one twice as wide), each of them
    whose grid is one wave also with ``one_per_sm`` toggled; only valid ones. None stands for a backend without
    tactics of its own (the reference, Triton's table)."""
    if backend in tactics.FMA_PATHS:
        base = tactics.default_fma_tactic(backend, m, hidden, sm_count)
        ffma = tactics.ffma_tactic(backend, m, hidden, sm_count)  # the base itself, except where that is warp MMA
        variants = [base, ffma] + [replace(ffma, split_k=k) for k in (ffma.split_k // 2, ffma.split_k * 2) if k >= 1]
        variants += [replace(ffma, tokens_per_cta=t) for t in (1, 2, 4, 8) if t != ffma.tokens_per_cta]
        variants += [replace(ffma, stages=2, burst=b) for b in (1, 2, 4)]
        variants += [replace(ffma, fuse=f) for f in tactics.FUSE_SHAPES if f != ffma.fuse]
        if m >= 8:
            for threads, tile_n in ((256, ffma.tile_n), (128, ffma.tile_n), (128, 2 * ffma.tile_n)):
                mma = replace(ffma, threads=threads, tile_n=tile_n, stages=1, burst=1, warp_mma=True)
                mma = replace(mma, split_k=hidden // mma.chunk_h)
                variants += [replace(mma, tokens_per_cta=t, fuse=f) for t in (16, 32) for f in tactics.FUSE_SHAPES]
    elif backend in tactics.MMA_PATHS:
        base = tactics.default_mma_tactic(backend, m, hidden, sm_count)
        variants = [base] + tactics.mma_shapes(base, m, hidden, sm_count)
    else:
        return [None]
    variants += [replace(base, fuse=f) for f in tactics.FUSE_SHAPES if f != base.fuse]
    if backend in tactics.FMA_PATHS:  # each one-wave grid also with its CTAs one to an SM
        variants += [replace(v, one_per_sm=not v.one_per_sm) for v in variants
                     if tactics.fits_one_wave(v, m, sm_count)]
    return list(dict.fromkeys(v for v in variants if v.invalid_reason(hidden) is None))


def candidate_groups(hiddens, ms, names, sm_count: int) -> list:
    """What ``tune`` times: per (H, M bucket of ``ms``), ``(H, bucket, [(backend, tactic, is its default)])``
    over ``names`` (``candidate_tactics``; the tactic None for a backend without tactics of its own)."""
    buckets = sorted({bucket_of(m) for m in ms})
    return [(h, b, [(name, t, i == 0) for name in names for i, t in enumerate(candidate_tactics(name, b, h, sm_count))])
            for h in hiddens for b in buckets]


def candidate_kernels(groups) -> list:
    """(H, tactic) of every CuTe kernel among ``candidate_groups``' candidates (the ones ``tune`` compiles)."""
    return [(h, t) for h, _, cands in groups for _, t, _ in cands if t is not None]


def auto_candidates(hidden: int, max_m: int, precision: str, sm_count: int) -> list:
    """(H, tactic) of every CuTe kernel ``auto`` may run for 1 to ``max_m`` tokens on an NVIDIA GPU with
    ``sm_count`` SMs, with or without the fused norm: each bucket's pick in every table (user cache and shipped)
    of this SM count, H and precision, whichever GPU name it carries (a superset of one GPU's), and the default
    tactic at every M of each path that runs without a tactic (the heuristic's ``half_fma`` and ``half_mma``,
    ``backends.pick_auto``, and any path a table names without one)."""
    defaulted, picks = {"half_fma", "half_mma"}, []
    tables = load_shipped_tables()
    tables.update(load_user_tables())
    for key, rows in tables.items():
        k = TuneKey.parse(key)
        if (k.sm_count, k.hidden, k.precision) != (sm_count, hidden, precision):
            continue
        for bucket in all_buckets(max_m):
            choice = nearest(rows, bucket)
            if choice is None or choice.backend not in tactics.FMA_PATHS + tactics.MMA_PATHS:
                continue
            tactic = tactic_or_none(choice)
            if tactic is None:
                defaulted.add(choice.backend)
            else:
                picks.append((hidden, tactic))
    defaults = [(hidden, tactics.default_tactic(path, m, hidden, sm_count)) for path in sorted(defaulted)
                for m in range(1, max_m + 1)]
    return list(dict.fromkeys(picks + defaults))


# the seam kernels each op's ``auto`` may run, as (seam, form): ``kernels.delayed_mode``'s seam flag and the form
SEAM_VARIANTS = {
    "mhc_fused_hc": tuple((None, form) for form in FORMS),
    "mhc_fused_hc_delayed": tuple((seam, form) for seam in ("carried", "identity") for form in FORMS),
    "mhc_head": ((None, "no_post"),),  # its seam form: the no-post seam on the padded head weight
}


def precompile_candidates(candidates, precision: str, norm_dtype: str | None,
                          variants=((None, "regular"),)) -> int:
    """Compile the CuTe kernels of (H, tactic) ``candidates`` in parallel worker processes before timing them
    (compiling one takes seconds); they persist in ``$MHC_CUTE_KERNEL_CACHE``, a temporary folder if unset.
    ``norm_dtype``: the norm weight's dtype name ("bfloat16", "float32"), or None without the fused norm;
    ``variants``: the (seam, form) pairs of each (``SEAM_VARIANTS``; the broadcast entry where the path runs it
    at that H). Returns how many variants it compiled (or found compiled)."""
    from .backends import BACKENDS

    os.environ.setdefault(KERNEL_CACHE_ENV, tempfile.mkdtemp(prefix="mhc_cute_kernels_"))
    fma_specs, mma_specs = [], []
    for seam, form in dict.fromkeys(variants):
        tail = (seam, form) if form != "regular" else () if seam is None else (seam,)
        for h, t in candidates:
            if h % BACKENDS[t.path].h_multiple_for(form):
                continue
            if t.path in tactics.FMA_PATHS:
                fma_specs.append((t.name, h, norm_dtype, *tail))
            else:
                mma_specs.append((t.name, h, precision, norm_dtype, *tail))
    fma_specs, mma_specs = list(dict.fromkeys(fma_specs)), list(dict.fromkeys(mma_specs))
    if fma_specs:
        from .kernels import fma

        fma.precompile(fma_specs)
    if mma_specs:
        from .kernels import mma

        mma.precompile(mma_specs)
    return len(fma_specs) + len(mma_specs)


TUNE_MARGIN = 0.02  # a non-default tactic must beat every backend's default by this much to be kept
MEASURES = ("contexts", "back-to-back")
CONTEXT_SHORTLIST = 8  # the fastest back-to-back candidates (and every default) that the contexts re-rank


def pick(timed: list) -> tuple | None:
    """From ``timed`` [(µs, backend, tactic, is the backend's default)], the fastest default, unless a
    non-default tactic is more than ``TUNE_MARGIN`` faster than it."""
    defaults = [c for c in timed if c[3]]
    others = [c for c in timed if not c[3]]
    best_default = min(defaults, key=lambda c: c[0], default=None)
    best_other = min(others, key=lambda c: c[0], default=None)
    if best_default is None or (best_other is not None and best_other[0] < best_default[0] * (1 - TUNE_MARGIN)):
        return best_other
    return best_default


def worst_context(timed: list, sets: list[dict], precision: str, delayed: bool = False) -> list:
    """``timed`` re-scored by the worst of three contexts: back to back (the graph time it has), after each of
    ``benchmark.context_predecessors`` (``benchmark.time_after``). Only the ``CONTEXT_SHORTLIST`` fastest back-to-back
    candidates and each backend's default are kept: the contexts move a pick by a microsecond or two, and timing
    them takes longer than a back-to-back graph."""
    ranked = sorted(timed, key=lambda c: c[0])
    shortlist = ranked[:CONTEXT_SHORTLIST] + [c for c in ranked[CONTEXT_SHORTLIST:] if c[3]]
    predecessors = bm.context_predecessors(sets).values()
    out = []
    for us, name, t, default in shortlist:
        call = bm.mhc_cute_call(name, precision, t, delayed)
        try:
            worst = max([us] + [bm.time_after(call, sets, p).after_us for p in predecessors])
        except Exception:  # as in the back-to-back timing: a candidate that fails to run is dropped
            continue
        out.append((worst, name, t, default))
    return out


def tune(device: torch.device, hiddens, ms, precision: str, norm: bool, names, log=progress,
         measure: str = "contexts", seam: str = "v4") -> dict:
    """Time every candidate (backend, tactic) per M bucket with CUDA-graph replay over rotated inputs and keep
    the fastest that is correct; tactics that fail to run are skipped. ``measure="contexts"`` ranks buckets up to
    ``benchmark.CONTEXT_MAX_M`` by the worst of back to back and after each kernel a call follows in a model
    (``worst_context``: the back-to-back winner can lose after a cuBLAS GEMM that lets it launch early, see
    docs/performance.md); ``"back-to-back"`` by the graph time alone. A backend's own default
    tactic (the first candidate) wins over a non-default one that is less than ``TUNE_MARGIN`` faster: a timing
    differs by a few percent from run to run at a few µs, and the defaults are what the tests cover most. Once every
    bucket is timed, each pick is checked against the float64 contract (``accuracy.failure_of``) on the bucket's
    first input set; a wrong one is dropped and the next pick checked. ``seam="delayed"`` tunes
    ``mhc_fused_hc_delayed`` (carried gates) into its own tables. Returns {TuneKey string: {bucket: Choice}}
    (``Choice.us``: the score)."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    if seam not in SEAMS:
        raise ValueError(f"seam must be one of {SEAMS}, got {seam!r}")
    delayed = seam == "delayed"
    with_seam = bm.with_carried_gates if delayed else (lambda sets: sets)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    groups = candidate_groups(hiddens, ms, names, sm_count)
    variants = (("carried", "regular"),) if delayed else ((None, "regular"),)
    precompile_candidates(candidate_kernels(groups), precision, bm.NORM_DTYPE if norm else None, variants)
    total = sum(len(cands) for _, _, cands in groups)
    done = 0
    scored = []
    for h, b, cands in groups:
        torch.cuda.empty_cache()
        sets = with_seam(bm.rotated_sets(b, h, device, norm))
        timed = []
        for name, t, default in cands:
            log(done, total, f"H={h} M={b} {name} {getattr(t, 'name', '')}")
            done += 1
            try:
                timed.append((bm.time_graph(bm.mhc_cute_call(name, precision, t, delayed), sets), name, t, default))
            except Exception:  # a tactic that fails to run is not a candidate
                continue
        if measure == "contexts" and b <= bm.CONTEXT_MAX_M:
            timed = worst_context(timed, sets, precision, delayed)
        scored.append((h, b, timed))
        del sets
    # The float64 checks come after all the timing: a candidate timed right after a check ran slower than the same
    # tactic timed before it (docs/experiments.md).
    tables: dict[str, dict[int, Choice]] = {}
    for h, b, timed in scored:
        torch.cuda.empty_cache()
        problem = accuracy.problem_of(with_seam(bm.make_sets(b, h, 1, device, norm))[0], precision)
        while (choice := pick(timed)) is not None:
            us, name, t, _ = choice
            why = accuracy.failure_of(problem, name, t)
            if why is None:
                key = TuneKey.for_device(device, h, precision, norm, seam).as_str()
                tables.setdefault(key, {})[b] = Choice(name, getattr(t, "name", None), us)
                break
            warnings.warn(f"mhc_cute tune: H={h} M={b} {name} {getattr(t, 'name', '')} is wrong ({why})")
            timed.remove(choice)
    log(total, total, "done")
    return tables
