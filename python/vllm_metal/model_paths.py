"""Model arguments that are GGUF files become prepared directories.

vLLM's front end reads a config.json and a tokenizer from a directory; a GGUF
file carries both in its metadata. `prepare_gguf_dir` (vllm_metal.models)
writes them next to a link to the file, once, in a cache directory.
"""

from __future__ import annotations

from pathlib import Path

SOURCE_MARKER = "vllm_metal_gguf_source.txt"


def resolve_model_argument(value: str) -> str:
    """argparse type of --model / model_tag / --tokenizer: *.gguf -> directory."""
    if value is None or not str(value).lower().endswith(".gguf"):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"[vllm-metal] GGUF file not found: {value}")
    from vllm_metal.models import prepare_gguf_dir

    directory = prepare_gguf_dir(str(path.resolve()))
    marker = Path(directory) / SOURCE_MARKER
    if not marker.exists():
        marker.write_text(str(value))
    return directory


def gguf_source_of(model: str) -> str | None:
    """The GGUF path a prepared directory was made from, else None."""
    marker = Path(str(model)) / SOURCE_MARKER
    try:
        return marker.read_text().strip() or None
    except OSError:
        return None
