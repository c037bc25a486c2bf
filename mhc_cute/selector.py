"""The runtime choice of ``backend="auto"``: M buckets, the tuned tables (user cache, shipped defaults) and
their lookup, memoised per call signature. The offline tuner that writes the tables is ``autotune``.

M buckets (``bucket_of``): M <= 128 maps to the next power of two (1, 2, 4, ..., 128); 128 < M <= 8192 to the
next multiple of 128 (256, 384, ..., 8192); M > 8192 to the next power of two (16384, 32768, ...). A table holds
winners for some buckets; a bucket it lacks takes the winner of the nearest tuned bucket (log distance, the
larger on ties), so a table tuned on a coarse grid still covers every M.

Tables are keyed by ``TuneKey`` (GPU name, SM count, H, precision, norm on/off, package version, seam: the V4
seam's tables, or ``mhc_fused_hc_delayed``'s own, whose kernel 1 does more and whose big fuse less). Lookup order:
the user's cache (``$MHC_CUTE_CACHE_DIR`` or ``$XDG_CACHE_HOME/mhc_cute`` or ``~/.cache/mhc_cute``,
``tuned.json``), then the tables shipped in ``mhc_cute/tuned/``, then a shipped table measured on another GPU of the
same architecture (compute capability) and SM count, the first file's by name (an H800 takes the H100's: the same
SMs and L2, and at the sizes where the picks differ most from the heuristic the call is bound by latency), then
the heuristic of ``backends.pick_auto``. A table for this GPU, of the call's norm flag or the other, wins over a
stand-in. The delayed seam takes a table of its own (this GPU's, then a stand-in) from that table's smallest tuned
bucket up, else the V4 seam's. A corrupt or stale cache file is ignored with a warning. ``MHC_CUTE_BACKEND`` forces a
backend and ``MHC_CUTE_TACTIC`` a tactic name for it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import NamedTuple

import torch

from . import backends
from .version import __version__

CACHE_FORMAT = 1
SEAMS = ("v4", "delayed")  # whose tables: mhc_fused_hc's (and the ops that run its kernels), mhc_fused_hc_delayed's


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
    seam: str = "v4"  # SEAMS

    def as_str(self) -> str:
        key = f"{self.gpu}|{self.sm_count}|H{self.hidden}|{self.precision}|norm{int(self.norm)}|v{self.version}"
        return key if self.seam == "v4" else f"{key}|{self.seam}"  # the V4 seam's keys as before seams existed

    @staticmethod
    def parse(key: str) -> "TuneKey":
        """The inverse of ``as_str``."""
        gpu, sm_count, hidden, precision, norm, version, *seam = key.split("|")
        if len(seam) > 1 or seam and seam[0] not in SEAMS[1:]:
            raise ValueError(f"unknown seam in tuning key {key!r}")
        return TuneKey(gpu, int(sm_count), int(hidden.removeprefix("H")), precision, norm == "norm1",
                       version.removeprefix("v"), *seam)

    @staticmethod
    def for_device(device: torch.device, hidden: int, precision: str, norm: bool, seam: str = "v4") -> "TuneKey":
        p = torch.cuda.get_device_properties(device)
        return TuneKey(p.name, p.multi_processor_count, hidden, precision, norm, __version__, seam)


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


generation = 0  # changes whenever a selector may resolve differently (a new selector, a reload): callers that keep
# what ``resolve`` returned (the API's plans) keep it under this generation


def _next_generation() -> None:
    global generation
    generation += 1


class Selector:
    """Resolves (device, M, H, precision, norm, seam) to a Choice; tables are read once per process."""

    def __init__(self):
        self._tables: dict[str, dict[int, Choice]] | None = None
        self._stand_ins: dict[TuneKey, str] = {}
        self._keys: dict[tuple, str] = {}
        self._resolved: dict[tuple, tuple] = {}
        _next_generation()

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
        _next_generation()

    def choose(self, device: torch.device, m: int, hidden: int, precision: str, norm: bool,
               seam: str = "v4") -> Choice | None:
        """The tuned choice at M's bucket, or None. The V4 seam's table (``table_key``) covers every M (its nearest
        tuned bucket); a table of the delayed seam covers M from its smallest tuned bucket up (it may be tuned at
        prefill sizes only, where its kernel 1 differs most): the first of them in lookup order that covers M serves
        it, else the V4 seam's table."""
        bucket = bucket_of(m)
        if seam == "delayed":
            for key in self.table_keys(device, hidden, precision, norm, "delayed"):
                if bucket >= min(self.tables()[key]):
                    return nearest(self.tables()[key], bucket)
        key = self.table_key(device, hidden, precision, norm)
        return None if key is None else nearest(self.tables()[key], bucket)

    def table_key(self, device: torch.device, hidden: int, precision: str, norm: bool,
                  seam: str = "v4") -> str | None:
        """The key of the table of ``seam`` (``SEAMS``) that ``auto`` looks at first on ``device`` (``table_keys``),
        or None: no such table."""
        return next(iter(self.table_keys(device, hidden, precision, norm, seam)), None)

    def table_keys(self, device: torch.device, hidden: int, precision: str, norm: bool, seam: str = "v4") -> list:
        """The keys of ``seam``'s tables for ``device`` in lookup order: this GPU's, where a table tuned without the
        fused norm stands in for one with it (and back), since the norm adds the same small epilogue to every
        backend; then shipped tables of the same architecture and SM count (module docstring)."""
        tables = self.tables()
        keys = [self._key(device, hidden, precision, n, seam) for n in (norm, not norm)]
        cc = "{}.{}".format(*torch.cuda.get_device_capability(device))
        stand_ins = [self._stand_ins.get(architecture_key(key, cc)) for key in keys]
        return [key for key in keys if key in tables] + [key for key in stand_ins if key is not None]

    def _key(self, device: torch.device, hidden: int, precision: str, norm: bool, seam: str) -> str:
        kk = (device.index, hidden, precision, norm, seam)
        key = self._keys.get(kk)
        if key is None:
            key = self._keys[kk] = TuneKey.for_device(device, hidden, precision, norm, seam).as_str()
        return key

    def resolve(self, device: torch.device, m: int, hidden: int, precision: str, norm: bool, seam: str = "v4"):
        """(backend, tactic) for ``backend="auto"`` (``seam``: whose tables, ``SEAMS``): the env override, the tuned
        tables, else the heuristic.

        Memoised per (device, bucket, H, precision, norm, seam), so the hot path is one dictionary lookup.
        """
        key = (device.type, device.index, bucket_of(m), hidden, precision, norm, seam)
        hit = self._resolved.get(key)
        if hit is not None:
            return hit
        forced = os.environ.get("MHC_CUTE_BACKEND")
        if forced:
            hit = (forced, backends.parse_tactic(forced, os.environ.get("MHC_CUTE_TACTIC")))
        else:
            choice = None
            if device.type == "cuda" and torch.version.hip is None:
                choice = self.choose(device, m, hidden, precision, norm, seam)
            tactic = tactic_or_none(choice)
            if choice is not None and backends.unavailable_reason(choice.backend, device) is None:
                hit = (choice.backend, tactic)
            else:
                hit = (backends.pick_auto(device, m, hidden), None)
        self._resolved[key] = hit
        return hit


def tactic_or_none(choice: Choice | None):
    """The tactic of a table entry; one this version cannot parse (a table written by another version) falls
    back to the backend's default tactic with a warning."""
    if choice is None:
        return None
    try:
        return backends.parse_tactic(choice.backend, choice.tactic)
    except ValueError as e:
        warnings.warn(f"mhc_cute: tuned tactic {choice.tactic!r} not understood ({e}); using the default", stacklevel=3)
        return None


SELECTOR = Selector()
