"""Switches are read in one place: every `QUANTGATE_*` variable through quantgate/settings.py, and no code
outside tests assigns to the environment at run time (a kernel reading a switch while a test flips it would
race). Read from the source as text; nothing is imported."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("quantgate", "quantize", "serving", "evals", "gates", "flows", "fleet", "benchmarks")
READ = re.compile(r"""environ(\.get)?\s*[\[(]\s*["']QUANTGATE_|getenv\(\s*["']QUANTGATE_""")
WRITE = re.compile(r"""os\.environ\[[^\]]+\]\s*=(?!=)|\bputenv\(|\bsetenv\(""")


def _sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for ext in ("*.py", "*.cpp", "*.h") for p in (ROOT / folder).rglob(ext))


def _hits(pattern: re.Pattern[str], skip: Path | None = None) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _sources() if p != skip
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]


def test_quantgate_switches_are_read_only_through_settings():
    assert _hits(READ, skip=ROOT / "quantgate" / "settings.py") == []


def test_no_code_assigns_to_the_environment():
    assert _hits(WRITE) == []


def test_the_patterns_catch_what_they_are_for():
    assert READ.search('os.environ.get("QUANTGATE_ISA")') and READ.search('std::getenv("QUANTGATE_ISA")')
    assert WRITE.search('os.environ["QUANTGATE_ISA"] = "avx2"') and not WRITE.search('os.environ["X"] == "1"')
