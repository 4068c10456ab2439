"""The README stays a manual and the docs stay pages: its size, every relative link, and the metrics page naming
every public definition of `specbench/report/metrics.py`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def broken_links(page: Path) -> list[str]:
    out = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or a section of the same page
        path, _, anchor = target.partition("#")
        found = (page.parent / path).resolve()
        if not found.exists():
            out.append(target)
        elif anchor and found.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", found.read_text(encoding="utf-8"), flags=re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            if anchor not in slugs:
                out.append(target)
    return out


def test_the_readme_is_a_manual_under_9_kb():
    assert (ROOT / "README.md").stat().st_size < 9 * 1024


def test_every_relative_link_resolves():
    assert {p.name: broken_links(p) for p in pages() if broken_links(p)} == {}


def test_a_broken_link_is_caught(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [bad anchor](there.md#nowhere) [web](https://x.y)")
    assert broken_links(page) == ["missing.md", "there.md#nowhere"]


def test_the_metrics_page_names_every_definition():
    code = ast.parse((ROOT / "specbench" / "report" / "metrics.py").read_text(encoding="utf-8"))
    public = [n.name for n in code.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    page = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert public and [name for name in public if f"`{name}" not in page] == []
