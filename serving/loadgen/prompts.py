"""The shipped prompt set the load generator, the release's serving stage and the canary replay."""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.jsonl"


def load_prompts(path: str | Path | None = None) -> list[str]:
    """The shipped prompt set (serving/loadgen/prompts.jsonl: one {"prompt": ...} per line) or another one."""
    path = Path(path) if path else PROMPTS_FILE
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f'{path}:{n}: expected an object with a non-empty "prompt" string')
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts
