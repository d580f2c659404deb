"""Benchmark results written into the docs between marker comments
(`<!-- name:begin -->` ... `<!-- name:end -->`), so a rerun replaces its own
table and nothing else."""

from __future__ import annotations

import re
from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(path: Path, name: str, body: str, heading: str | None = None) -> None:
    """Replaces the `name` block of `path` with `body`; appends it (under `## heading`) when absent."""
    begin, end = markers(name)
    text = path.read_text()
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        title = f"## {heading}\n\n" if heading else ""
        text = text.rstrip("\n") + f"\n\n{title}{block}\n"
    path.write_text(text)
