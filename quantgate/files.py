"""Reading the YAML files users hand to quantgate (API keys, router configs): a ValueError naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed document; ValueError "<what> <path> does not exist / is not valid YAML: ..." otherwise."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} {path} is not valid YAML: {exc}") from exc
