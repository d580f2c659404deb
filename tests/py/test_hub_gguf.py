"""`owner/repo:TAG` references: parsing, picking the file by quant tag
(mmproj projectors skipped, split and ambiguous files refused with a message),
and resolution offline against a prepared Hugging Face cache into a served
directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hub_cache import make_hub_cache
from vllm_metal import hub_gguf
from vllm_metal.model_paths import resolve_model_argument
from vllm_metal.models.testing import tiny_config, write_tiny_gguf

FILES = ["README.md", "gemma-3-270m-it-Q4_K_M.gguf", "gemma-3-270m-it-Q4_K_S.gguf",
         "gemma-3-270m-it-Q8_0.gguf", "mmproj-gemma-3-270m-it-Q8_0.gguf", "BF16/gemma-3-270m-it-BF16.gguf"]


@pytest.mark.parametrize("value, want", [
    ("unsloth/gemma-3-270m-it-GGUF:Q4_K_M", ("unsloth/gemma-3-270m-it-GGUF", "Q4_K_M")),
    ("owner/repo.v2:q8_0", ("owner/repo.v2", "q8_0")),
    ("owner/repo", None),            # a plain repo id: vLLM's own business
    ("model.gguf", None),
    ("/abs/path/model.gguf", None),
    ("C:/weights:Q4", None),
])
def test_parse_reference(value, want):
    assert hub_gguf.parse_reference(value) == want


@pytest.mark.parametrize("tag, want", [
    ("Q4_K_M", "gemma-3-270m-it-Q4_K_M.gguf"),
    ("q4_k_s", "gemma-3-270m-it-Q4_K_S.gguf"),
    ("Q8_0", "gemma-3-270m-it-Q8_0.gguf"),      # not the mmproj file with the same tag
    ("BF16", "BF16/gemma-3-270m-it-BF16.gguf"),  # files in folders too
])
def test_pick_file_by_tag(tag, want):
    assert hub_gguf.pick_file(FILES, "o/r", tag) == want


def test_pick_file_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match=r"no GGUF file for tag 'Q4_K'.*Q4_K_M.gguf"):
        hub_gguf.pick_file(FILES, "o/r", "Q4_K")  # a prefix of Q4_K_M is not its tag
    with pytest.raises(ValueError, match="split GGUF files are not supported"):
        hub_gguf.pick_file(["m-Q4_0-00001-of-00002.gguf", "m-Q4_0-00002-of-00002.gguf"], "o/r", "Q4_0")
    with pytest.raises(ValueError, match="ambiguous"):
        hub_gguf.pick_file(["a-Q4_0.gguf", "b-Q4_0.gguf"], "o/r", "Q4_0")
    with pytest.raises(ValueError, match="no GGUF file for tag 'Q8_0'.*none"):
        hub_gguf.pick_file(["mmproj-Q8_0.gguf"], "o/r", "Q8_0")


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # prepared dirs go here
    return tmp_path / "hub"


def test_reference_resolves_offline_to_a_prepared_directory(tmp_path, offline_hub):
    cfg = tiny_config("qwen3")
    q8 = tmp_path / "q8.gguf"
    write_tiny_gguf(cfg, q8, qtype="Q8_0")
    make_hub_cache(offline_hub, "owner/tiny-GGUF", {
        "tiny-Q8_0.gguf": q8, "mmproj-tiny-Q8_0.gguf": b"not a model", "README.md": "hi"})
    directory = Path(resolve_model_argument("owner/tiny-GGUF:Q8_0"))
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["hidden_size"] == cfg["hidden_size"]
    assert (directory / "model.gguf").resolve() == q8.resolve()


def test_reference_not_in_the_cache_says_so(offline_hub):
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        resolve_model_argument("owner/absent-GGUF:Q4_K_M")
    make_hub_cache(offline_hub, "owner/other-GGUF", {"other-Q8_0.gguf": b"x"})
    with pytest.raises(ValueError, match=r"no GGUF file for tag 'Q4_K_M'.*other-Q8_0.gguf"):
        resolve_model_argument("owner/other-GGUF:Q4_K_M")
