"""A Hugging Face hub cache laid out as huggingface_hub writes it, made offline
in a test: models--owner--repo/{refs/main, snapshots/<commit>/<files>}."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def make_hub_cache(cache: Path, repo: str, files: dict[str, str | bytes | Path]) -> Path:
    """files: repo-relative name -> content, or a Path to link to. Returns the snapshot dir."""
    commit = hashlib.sha1(repo.encode()).hexdigest()
    root = Path(cache) / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    for name, content in files.items():
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            os.symlink(content.resolve(), target)
        else:
            target.write_bytes(content if isinstance(content, bytes) else content.encode())
    return snapshot
