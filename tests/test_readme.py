"""The README stays a front door: short, names the two commands, and every relative link in it and in docs/
resolves to a file in the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 220

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    docs = ROOT / "docs"
    return [README, *sorted(docs.glob("*.md")), *sorted((docs / "results").glob("*.md"))]


def relative_targets(text: str) -> list[str]:
    """Link targets outside code, without external URLs and in-page anchors."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    targets = [m.group(1) for m in LINK.finditer(prose)]
    return [t for t in targets if not EXTERNAL.match(t) and not t.startswith("#")]


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the limit is {MAX_README_LINES}"


def test_readme_names_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text


def test_link_extraction_skips_code_urls_and_anchors():
    text = "[a](x.md) `[b](no.md)` [c](https://e.org) [d](#top) ![e](img/p.png#f)\n```\n[g](no2.md)\n```\n"
    assert relative_targets(text) == ["x.md", "img/p.png#f"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for target in relative_targets(path.read_text(encoding="utf-8")):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: links to missing files: {broken}"
