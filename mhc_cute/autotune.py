"""Tactic selection for ``backend="auto"``: M buckets, tuned tables (user cache, shipped defaults), the tuner.

M buckets (``bucket_of``): M <= 128 maps to the next power of two (1, 2, 4, ..., 128); 128 < M <= 8192 to the
next multiple of 128 (256, 384, ..., 8192); M > 8192 to the next power of two (16384, 32768, ...). A table holds
winners for some buckets; a bucket it lacks takes the winner of the nearest tuned bucket (log distance, the
larger on ties), so a table tuned on a coarse grid still covers every M.

Tables are keyed by ``TuneKey`` (GPU name, SM count, H, precision, norm on/off, package version). Lookup order:
the user's cache (``$MHC_CUTE_CACHE_DIR`` or ``$XDG_CACHE_HOME/mhc_cute`` or ``~/.cache/mhc_cute``,
``tuned.json``), then the tables shipped in ``mhc_cute/tuned/``, then a shipped table measured on another GPU of the
same architecture (compute capability) and SM count (an H100 SXM or H800 takes the H200's: the same SMs and L2,
and at the sizes where the picks differ most from the heuristic the call is bound by latency, not bandwidth), then
the heuristic of ``backends.pick_auto``. A table for this GPU, of the call's norm flag or the other, wins over a
stand-in. A corrupt or stale cache file is ignored with a warning. ``MHC_CUTE_BACKEND`` forces a backend and
``MHC_CUTE_TACTIC`` a tactic name for it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import NamedTuple

import torch

CACHE_FORMAT = 1


def bucket_of(m: int) -> int:
    """The M bucket that tokens count ``m`` (>= 1) is tuned and dispatched under."""
    if m <= 128:
        return 1 << (m - 1).bit_length()
    if m <= 8192:
        return -(-m // 128) * 128
    return 1 << (m - 1).bit_length()


def all_buckets(max_m: int = 16384) -> list[int]:
    out, m = [], 1
    while m <= max_m:
        b = bucket_of(m)
        out.append(b)
        m = b + 1
    return out


@dataclass(frozen=True)
class TuneKey:
    gpu: str
    sm_count: int
    hidden: int
    precision: str
    norm: bool
    version: str

    def as_str(self) -> str:
        return f"{self.gpu}|{self.sm_count}|H{self.hidden}|{self.precision}|norm{int(self.norm)}|v{self.version}"

    @staticmethod
    def parse(key: str) -> "TuneKey":
        """The inverse of ``as_str``."""
        gpu, sm_count, hidden, precision, norm, version = key.split("|")
        return TuneKey(gpu, int(sm_count), int(hidden.removeprefix("H")), precision, norm == "norm1",
                       version.removeprefix("v"))

    @staticmethod
    def for_device(device: torch.device, hidden: int, precision: str, norm: bool) -> "TuneKey":
        from . import __version__

        p = torch.cuda.get_device_properties(device)
        return TuneKey(p.name, p.multi_processor_count, hidden, precision, norm, __version__)


@dataclass(frozen=True)
class Choice:
    backend: str
    tactic: str | None  # the tactic's name, or None for the backend's own default
    us: float | None = None  # measured graph-replay µs when tuned


def cache_path() -> str:
    root = os.environ.get("MHC_CUTE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mhc_cute")
    return os.path.join(root, "tuned.json")


def _read_tables(text: str, origin: str) -> dict[str, dict[int, Choice]]:
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        raise ValueError(f"unknown format in {origin}")
    tables = {}
    for key, rows in data["tables"].items():
        tables[key] = {int(b): Choice(c["backend"], c.get("tactic"), c.get("us")) for b, c in rows.items()}
    return tables


def load_user_tables(path: str | None = None) -> dict[str, dict[int, Choice]]:
    path = path or cache_path()
    try:
        with open(path) as f:
            return _read_tables(f.read(), path)
    except FileNotFoundError:
        return {}
    except Exception as e:  # corrupt or stale: tuning again fixes it; never fatal
        warnings.warn(f"mhc_cute: ignoring the tuning cache {path} ({type(e).__name__}: {e})", stacklevel=2)
        return {}


class ShippedFile(NamedTuple):
    name: str
    compute_capability: str | None  # "9.0": the architecture its tables were measured on (None: exact GPU only)
    tables: dict[str, dict[int, Choice]]


def shipped_files() -> list[ShippedFile]:
    """The tables shipped in ``mhc_cute/tuned/``, one entry per file (an unreadable file is skipped with a warning)."""
    out = []
    try:
        files = [f for f in resources.files("mhc_cute").joinpath("tuned").iterdir() if f.name.endswith(".json")]
    except (FileNotFoundError, NotADirectoryError):
        return out
    for f in sorted(files, key=lambda f: f.name):
        try:
            text = f.read_text()
            out.append(ShippedFile(f.name, json.loads(text).get("compute_capability"), _read_tables(text, f.name)))
        except Exception as e:
            warnings.warn(f"mhc_cute: ignoring the shipped table {f.name} ({e})", stacklevel=2)
    return out


def load_shipped_tables(files: list[ShippedFile] | None = None) -> dict[str, dict[int, Choice]]:
    """The shipped tables by key (of ``files``, or of every shipped file)."""
    return {key: rows for f in (shipped_files() if files is None else files) for key, rows in f.tables.items()}


def architecture_key(key: str, compute_capability: str) -> TuneKey:
    """``key`` with its GPU name replaced by the architecture: the key under which a table stands in for GPUs of the
    same compute capability and SM count."""
    return replace(TuneKey.parse(key), gpu=f"sm {compute_capability}")


def stand_in_keys(files: list[ShippedFile]) -> dict[TuneKey, str]:
    """{``architecture_key``: a shipped key measured on such a GPU}; of several GPUs, the first file's (sorted by
    name) is kept."""
    out = {}
    for f in files:
        if f.compute_capability is not None:
            for key in f.tables:
                out.setdefault(architecture_key(key, f.compute_capability), key)
    return out


def save_user_tables(tables: dict[str, dict[int, Choice]], path: str | None = None) -> str:
    """Merge ``tables`` into the user's cache file, atomically (write a temporary file, then rename)."""
    path = path or cache_path()
    merged = load_user_tables(path)
    for key, rows in tables.items():
        merged.setdefault(key, {}).update(rows)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    payload = {"format": CACHE_FORMAT, "tables": {
        k: {str(b): asdict(c) for b, c in sorted(rows.items())} for k, rows in merged.items()}}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tuned-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)
    return path


def nearest(rows: dict[int, Choice], bucket: int) -> Choice | None:
    if not rows:
        return None
    if bucket in rows:
        return rows[bucket]
    best = min(rows, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), -b))
    return rows[best]


class Selector:
    """Resolves (device, M, H, precision, norm) to a Choice; tables are read once per process."""

    def __init__(self):
        self._tables: dict[str, dict[int, Choice]] | None = None
        self._stand_ins: dict[TuneKey, str] = {}
        self._keys: dict[tuple, str] = {}
        self._resolved: dict[tuple, tuple] = {}

    def tables(self) -> dict[str, dict[int, Choice]]:
        if self._tables is None:
            files = shipped_files()
            tables = load_shipped_tables(files)
            tables.update(load_user_tables())  # the user's own tuning wins over shipped defaults
            self._stand_ins = stand_in_keys(files)
            self._tables = tables
        return self._tables

    def reload(self) -> None:
        """Forget the tables and the memoised choices (after tuning, or a change of MHC_CUTE_* variables)."""
        self._tables = None
        self._resolved.clear()

    def choose(self, device: torch.device, m: int, hidden: int, precision: str, norm: bool) -> Choice | None:
        """The tuned choice (``table_key``'s table at M's bucket), or None."""
        key = self.table_key(device, hidden, precision, norm)
        return None if key is None else nearest(self.tables()[key], bucket_of(m))

    def table_key(self, device: torch.device, hidden: int, precision: str, norm: bool) -> str | None:
        """The key of the table ``auto`` uses on ``device``: this GPU's, where a table tuned without the fused norm
        stands in for one with it (and back), since the norm adds the same small epilogue to every backend; then a
        shipped table of the same architecture and SM count (module docstring); None: the heuristic."""
        tables = self.tables()
        keys = [self._key(device, hidden, precision, n) for n in (norm, not norm)]
        for key in keys:
            if key in tables:
                return key
        cc = "{}.{}".format(*torch.cuda.get_device_capability(device))
        for key in keys:
            stand_in = self._stand_ins.get(architecture_key(key, cc))
            if stand_in is not None:
                return stand_in
        return None

    def _key(self, device: torch.device, hidden: int, precision: str, norm: bool) -> str:
        kk = (device.index, hidden, precision, norm)
        key = self._keys.get(kk)
        if key is None:
            key = self._keys[kk] = TuneKey.for_device(device, hidden, precision, norm).as_str()
        return key

    def resolve(self, device: torch.device, m: int, hidden: int, precision: str, norm: bool):
        """(backend, tactic) for ``backend="auto"``: the env override, the tuned tables, else the heuristic.

        Memoised per (device, bucket, H, precision, norm), so the hot path is one dictionary lookup.
        """
        from . import backends

        key = (device.type, device.index, bucket_of(m), hidden, precision, norm)
        hit = self._resolved.get(key)
        if hit is not None:
            return hit
        forced = os.environ.get("MHC_CUTE_BACKEND")
        if forced:
            hit = (forced, parse_tactic(forced, os.environ.get("MHC_CUTE_TACTIC")))
        else:
            choice = None
            if device.type == "cuda" and torch.version.hip is None:
                choice = self.choose(device, m, hidden, precision, norm)
            tactic = _tactic_or_none(choice)
            if choice is not None and backends.unavailable_reason(choice.backend, device) is None:
                hit = (choice.backend, tactic)
            else:
                hit = (backends.pick_auto(device, m, hidden), None)
        self._resolved[key] = hit
        return hit


def parse_tactic(backend: str, name: str | None):
    """The tactic object of ``backend`` named ``name`` (None: the backend's own default)."""
    if name is None:
        return None
    from . import tactics

    return tactics.parse_tactic(name)


def _tactic_or_none(choice: Choice | None):
    """The tactic of a table entry; one this version cannot parse (a table written by another version) falls
    back to the backend's default tactic with a warning."""
    if choice is None:
        return None
    try:
        return parse_tactic(choice.backend, choice.tactic)
    except ValueError as e:
        warnings.warn(f"mhc_cute: tuned tactic {choice.tactic!r} not understood ({e}); using the default", stacklevel=3)
        return None


SELECTOR = Selector()


def progress(i: int, n: int, label: str) -> None:
    width = 30
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:60]:60s}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()



def candidate_tactics(backend: str, m: int, hidden: int, sm_count: int) -> list:
    """What the tuner times for ``backend`` at M = ``m``: its default tactic (the first) and its neighbours in the
    big-fuse shape (two-launch paths); for the tensor-core paths in split_k (half and double) and M tile; for the
    FMA paths the FFMA-projection tactic (``tactics.ffma_tactic``, the default itself outside 9 <= M <= 128) and its
    neighbours in split_k, tokens per CTA, big-fuse shape and the weight pipeline with wider post-map steps (where a
    CTA walks several chunks: at M = 32 on an H200, ``stages=2, burst=4`` took 17% less time than the FFMA
    tactic), and from M = 8 the projection on warp MMA (16 or 32 tokens per CTA, one chunk per CTA, each big-fuse
    shape; 256 threads, or 128 with the FFMA tactic's chunk or one twice as wide: the 128-thread 64-position chunk
    won at H = 7168, M = 16 on the H200), each of them whose grid is one wave also with ``one_per_sm`` toggled; only
    valid ones. None stands for a backend without tactics of its own
    (the reference, Triton's table)."""
    from . import tactics

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
        variants = [base] + [replace(base, split_k=k) for k in (base.split_k // 2, base.split_k * 2) if k >= 1]
        variants += [replace(base, tile_m=t) for t in (64, 128) if t != base.tile_m]
    else:
        return [None]
    variants += [replace(base, fuse=f) for f in tactics.FUSE_SHAPES if f != base.fuse]
    if backend in tactics.FMA_PATHS:  # each one-wave grid also with its CTAs one to an SM
        variants += [replace(v, one_per_sm=not v.one_per_sm) for v in variants
                     if tactics.fits_one_wave(v, m, sm_count)]
    return list(dict.fromkeys(v for v in variants if v.invalid_reason(hidden) is None))


def auto_candidates(hidden: int, max_m: int, precision: str, sm_count: int) -> list:
    """(H, tactic) of every CuTe kernel ``auto`` may run for 1 to ``max_m`` tokens on an NVIDIA GPU with
    ``sm_count`` SMs, with or without the fused norm: each bucket's pick in every table (user cache and shipped)
    of this SM count, H and precision, whichever GPU name it carries (a superset of one GPU's), and the default
    tactic at every M of each path that runs without a tactic (the heuristic's ``half_fma`` and ``half_mma``,
    ``backends.pick_auto``, and any path a table names without one)."""
    from . import tactics

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
            tactic = _tactic_or_none(choice)
            if tactic is None:
                defaulted.add(choice.backend)
            else:
                picks.append((hidden, tactic))
    defaults = [(hidden, tactics.default_tactic(path, m, hidden, sm_count)) for path in sorted(defaulted)
                for m in range(1, max_m + 1)]
    return list(dict.fromkeys(picks + defaults))


def precompile_candidates(candidates, precision: str, norm_dtype: str | None) -> None:
    """Compile the CuTe kernels of (H, tactic) ``candidates`` in parallel worker processes before timing them
    (compiling one takes seconds); they persist in ``$MHC_CUTE_KERNEL_CACHE``, a temporary folder if unset.
    ``norm_dtype``: the norm weight's dtype name ("bfloat16", "float32"), or None without the fused norm."""
    import tempfile

    from . import tactics
    from .kernels import KERNEL_CACHE_ENV

    os.environ.setdefault(KERNEL_CACHE_ENV, tempfile.mkdtemp(prefix="mhc_cute_kernels_"))
    fma_specs = [(t.name, h, norm_dtype) for h, t in candidates if t.path in tactics.FMA_PATHS]
    mma_specs = [(t.name, h, precision, norm_dtype) for h, t in candidates if t.path in tactics.MMA_PATHS]
    if fma_specs:
        from .kernels import fma

        fma.precompile(fma_specs)
    if mma_specs:
        from .kernels import mma

        mma.precompile(mma_specs)


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


def worst_context(timed: list, sets: list[dict], precision: str) -> list:
    """``timed`` re-scored by the worst of three contexts: back to back (the graph time it has), after each of
    ``benchmark.context_predecessors`` (``benchmark.time_after``). Only the ``CONTEXT_SHORTLIST`` fastest back-to-back
    candidates and each backend's default are kept: the contexts move a pick by a microsecond or two, and timing
    them takes longer than a back-to-back graph."""
    from . import benchmark as bm

    ranked = sorted(timed, key=lambda c: c[0])
    shortlist = ranked[:CONTEXT_SHORTLIST] + [c for c in ranked[CONTEXT_SHORTLIST:] if c[3]]
    predecessors = bm.context_predecessors(sets).values()
    out = []
    for us, name, t, default in shortlist:
        call = bm.mhc_cute_call(name, precision, t)
        try:
            worst = max([us] + [bm.time_after(call, sets, p).after_us for p in predecessors])
        except Exception:  # as in the back-to-back timing: a candidate that fails to run is dropped
            continue
        out.append((worst, name, t, default))
    return out


def tune(device: torch.device, hiddens, ms, precision: str, norm: bool, names, log=progress,
         measure: str = "contexts") -> dict:
    """Time every candidate (backend, tactic) per M bucket with CUDA-graph replay over rotated inputs and keep
    the fastest that is correct; tactics that fail to run are skipped. ``measure="contexts"`` ranks buckets up to
    ``benchmark.CONTEXT_MAX_M`` by the worst of back to back and after each kernel a call follows in a model
    (``worst_context``; on the H200 the back-to-back winner lost up to 1.9 µs after a cuBLAS GEMM that let it
    launch early, see docs/performance.md); ``"back-to-back"`` by the graph time alone. A backend's own default
    tactic (the first candidate) wins over a non-default one that is less than ``TUNE_MARGIN`` faster: a timing
    differs by a few percent from run to run at a few µs, and the defaults are what the tests cover most. Once every
    bucket is timed, each pick is checked against the float64 contract (``accuracy.failure_of``) on the bucket's
    first input set; a wrong one is dropped and the next pick checked. Returns {TuneKey string: {bucket: Choice}}
    (``Choice.us``: the score)."""
    from . import accuracy, benchmark as bm

    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    buckets = sorted({bucket_of(m) for m in ms})
    groups = [(h, b, [(name, t, i == 0) for name in names
                      for i, t in enumerate(candidate_tactics(name, b, h, sm_count))])
              for h in hiddens for b in buckets]
    precompile_candidates([(h, t) for h, _, cands in groups for _, t, _ in cands if t is not None], precision,
                          bm.NORM_DTYPE if norm else None)
    total = sum(len(cands) for _, _, cands in groups)
    done = 0
    scored = []
    for h, b, cands in groups:
        torch.cuda.empty_cache()
        sets = bm.rotated_sets(b, h, device, norm)
        timed = []
        for name, t, default in cands:
            log(done, total, f"H={h} M={b} {name} {getattr(t, 'name', '')}")
            done += 1
            try:
                timed.append((bm.time_graph(bm.mhc_cute_call(name, precision, t), sets), name, t, default))
            except Exception:  # a tactic that fails to run is not a candidate
                continue
        if measure == "contexts" and b <= bm.CONTEXT_MAX_M:
            timed = worst_context(timed, sets, precision)
        scored.append((h, b, timed))
        del sets
    # The float64 checks come after all the timing: the candidates timed right after a check ran up to 8% slower
    # than the same tactic timed before it (H200, bench/measured/h200_triton_sweep_wide_2026-12-03.txt).
    tables: dict[str, dict[int, Choice]] = {}
    for h, b, timed in scored:
        torch.cuda.empty_cache()
        problem = accuracy.problem_of(bm.make_sets(b, h, 1, device, norm)[0], precision)
        while (choice := pick(timed)) is not None:
            us, name, t, _ = choice
            why = accuracy.failure_of(problem, name, t)
            if why is None:
                key = TuneKey.for_device(device, h, precision, norm).as_str()
                tables.setdefault(key, {})[b] = Choice(name, getattr(t, "name", None), us)
                break
            warnings.warn(f"mhc_cute tune: H={h} M={b} {name} {getattr(t, 'name', '')} is wrong ({why})")
            timed.remove(choice)
    log(total, total, "done")
    return tables
