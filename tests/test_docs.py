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


def missing_links(folder: Path, text: str) -> list:
    """The relative link targets of ``text`` (a document in ``folder``) that are not files or folders there."""
    return [target for target in LINK.findall(text)
            if not target.startswith(("http://", "https://", "mailto:")) and not (folder / target).exists()]


def missing_logs(text: str) -> list:
    """The measurement logs ``text`` names in backticks that ``bench/measured/`` lacks."""
    return sorted({name for name in LOG_NAME.findall(text) if not (MEASURED / name).exists()})


def test_readme_size():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, at most {README_MAX_BYTES}: move depth to docs/"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    assert not (missing := missing_links(doc.parent, doc.read_text())), f"{doc.name}: links to missing {missing}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_logs_exist(doc):
    assert not (missing := missing_logs(doc.read_text())), f"{doc.name}: cites logs not in bench/measured/: {missing}"


def test_the_checks_catch_what_they_look_for():
    """A missing link target and a missing log are reported, present ones are not."""
    text = ("[gone](design_gone.md#x), [there](design.md#dispatch), `h200_bench_0000000_2026-01-01.txt`, "
            "`h200_bench_73e1ee4_2026-12-04.json`")
    assert missing_links(ROOT / "docs", text) == ["design_gone.md"]
    assert missing_logs(text) == ["h200_bench_0000000_2026-01-01.txt"]
