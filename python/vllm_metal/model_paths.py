"""Model arguments that are GGUF files become prepared directories.

vLLM's front end reads a config.json and a tokenizer from a directory; a GGUF
file carries both in its metadata. `prepare_gguf_dir` (vllm_metal.models)
writes them next to a link to the file, once, in a cache directory. A hub
reference `owner/repo:TAG` first resolves to one of the repo's GGUF files
(hub_gguf.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

SOURCE_MARKER = "vllm_metal_gguf_source.txt"


class ModelArgumentError(argparse.ArgumentTypeError, ValueError):
    """argparse prints an ArgumentTypeError's message; for a plain ValueError or OSError
    from a type function it prints only "invalid resolve_model_argument value"."""


# prepared directory -> the model argument as the user gave it (a .gguf path or owner/repo:TAG)
_given_as: dict[str, str] = {}


def resolve_model_argument(value: str) -> str:
    """argparse type of --tokenizer (and the draft model): *.gguf or owner/repo:TAG -> directory."""
    try:
        return _resolve_model_argument(value)
    except (ValueError, OSError) as e:
        raise ModelArgumentError(str(e)) from e


def resolve_served_model(value: str) -> str:
    """argparse type of --model / model_tag: resolve_model_argument, remembering the name
    given for name_models_as_given."""
    directory = resolve_model_argument(value)
    if directory != value:
        _given_as[directory] = value
    return directory


def name_models_as_given(namespace) -> None:
    """Parsed `vllm serve` arguments: a model argument that resolved to a prepared directory
    is served under the name it was given (`vllm serve ./m.gguf` answers requests for
    "./m.gguf" and lists it in /v1/models), unless --served-model-name names it. vLLM's front
    end names the model after args.model, which is the directory by then."""
    if getattr(namespace, "served_model_name", None) is not None:
        return
    for dest in ("model_tag", "model"):  # vLLM's serve: the positional one wins
        given = _given_as.get(getattr(namespace, dest, None))
        if given is not None:
            namespace.served_model_name = [given]
            return


def _resolve_model_argument(value: str) -> str:
    from vllm_metal import hub_gguf

    if value is None:
        return value
    reference = hub_gguf.parse_reference(value)
    if reference is not None:
        value = str(hub_gguf.resolve(*reference))
    elif not str(value).lower().endswith(".gguf"):
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
