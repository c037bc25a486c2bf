"""The user-facing documents: the README within its size, every relative link and every cited measurement log
present in the tree (a log named in a document is the evidence of a number there)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "bench" / "measured"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "probes" / "README.md",
             MEASURED / "README.md", ROOT / "tma_cache" / "README.md"]
README_MAX_BYTES = 16_000
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
LOG_NAME = re.compile(r"`((?:h100|h200|cpu)_[A-Za-z0-9_.\-]+\.(?:txt|json|png))`")


def test_readme_size():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, at most {README_MAX_BYTES}: move depth to docs/"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    missing = [target for target in LINK.findall(doc.read_text())
               if not target.startswith(("http://", "https://", "mailto:")) and not (doc.parent / target).exists()]
    assert not missing, f"{doc.name}: links to missing files {missing}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_logs_exist(doc):
    missing = sorted({name for name in LOG_NAME.findall(doc.read_text()) if not (MEASURED / name).exists()})
    assert not missing, f"{doc.name}: cites logs not in bench/measured/: {missing}"


def test_the_checks_catch_what_they_look_for():
    """A missing link target and a missing log are found (the patterns match the documents' forms)."""
    text = "see [the design](design_gone.md#x) and `h200_bench_0000000_2026-01-01.txt`"
    assert LINK.findall(text) == ["design_gone.md"]
    assert LOG_NAME.findall(text) == ["h200_bench_0000000_2026-01-01.txt"]
