"""`owner/repo:TAG` model references: one GGUF file of a Hugging Face repo.

The tag names the quantization (`unsloth/gemma-3-270m-it-GGUF:Q4_K_M`), as
llama.cpp's `-hf` takes it. The file is the repo's .gguf whose name carries the
tag as a whole word (`...-Q4_K_M.gguf`; `Q4_K` does not pick `Q4_K_M`);
multimodal projector files (`mmproj-*.gguf`) are never picked. Files come
through huggingface_hub: listed and downloaded when the hub is reachable, else
found in its local cache (HF_HUB_CACHE), so a machine that fetched the model
once serves it offline.
"""

from __future__ import annotations

import re
from pathlib import Path

_REFERENCE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+):(?P<tag>[A-Za-z0-9][\w.-]*)$")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.I)


def parse_reference(value: str) -> tuple[str, str] | None:
    """(repo id, tag) for "owner/repo:TAG", else None (local paths, plain repo ids)."""
    m = _REFERENCE.match(str(value))
    if m is None or Path(str(value)).exists():
        return None
    return m["repo"], m["tag"]


def pick_file(files: list[str], repo: str, tag: str) -> str:
    """The one model file of `files` (repo-relative paths) that `tag` names."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")
             and not Path(f).name.lower().startswith("mmproj")]
    word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(tag)}(?![A-Za-z0-9_])", re.I)
    hits = sorted(f for f in ggufs if word.search(Path(f).name))
    if not hits:
        raise ValueError(f"[vllm-metal] {repo} has no GGUF file for tag {tag!r}; its GGUF files: "
                         f"{', '.join(sorted(Path(f).name for f in ggufs)) or 'none'}")
    if any(_SPLIT.search(f) for f in hits):
        raise ValueError(f"[vllm-metal] {repo}:{tag} is split over several files "
                         f"({', '.join(hits)}); split GGUF files are not supported: merge them "
                         "with llama.cpp's gguf-split --merge and serve the merged file")
    if len(hits) > 1:
        raise ValueError(f"[vllm-metal] {repo}:{tag} is ambiguous: {', '.join(hits)}; "
                         "serve one of them by path")
    return hits[0]


def resolve(repo: str, tag: str, cache_dir: str | None = None) -> Path:
    """Local path of the file `repo:tag` names (downloaded if needed and possible)."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        files = HfApi().list_repo_files(repo)
    except Exception as online_error:  # offline, hub unreachable, or repo unknown online
        try:
            snapshot = Path(snapshot_download(repo, cache_dir=cache_dir, local_files_only=True))
        except LocalEntryNotFoundError:
            raise ValueError(f"[vllm-metal] {repo}:{tag}: the hub is not reachable "
                             f"({type(online_error).__name__}) and the repo is not in the local "
                             "Hugging Face cache") from None
        files = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf")]
        return snapshot / pick_file(files, repo, tag)
    return Path(hf_hub_download(repo, pick_file(files, repo, tag), cache_dir=cache_dir))
