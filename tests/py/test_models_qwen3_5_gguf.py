"""Qwen3.5 text as llama.cpp writes it ("qwen35" GGUF, written here with the gguf package)
and the packed serving forward, against mlx-lm's own Qwen3.5 forward on the same weights:
the GGUF's config and tokens equal the safetensors checkpoint's, an MTP block in the file
is ignored, block-form (Q8_0) weights with reordered value heads equal their dequantized
form, and several requests packed per step (decode rows + chunked prefills) decode what
mlx-lm decodes for each alone."""

from __future__ import annotations

import numpy as np
import pytest

from qwen3_5_checkpoint import (CONFIG, greedy, random_model, reference_model, run_packed_greedy,
                                write_checkpoint, write_gguf)

from vllm_metal.models import load_model

PROMPTS = [[5, 17, 3, 88, 42, 1, 9, 60, 23, 71, 4], [7, 7, 30, 2], list(range(100, 117)), [250]]
STEPS = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen35")
    model = random_model(seed=0)
    return dict(safetensors=write_checkpoint(d / "st", seed=0),
                f32=write_gguf(model, d / "m.gguf"),
                mtp=write_gguf(model, d / "mtp.gguf", mtp=True),
                q8=write_gguf(model, d / "q8.gguf", qtype="Q8_0"))


@pytest.fixture(scope="module")
def reference_tokens(files):
    ref = reference_model(files["safetensors"])
    return [greedy(ref, p, STEPS) for p in PROMPTS]


def test_packed_batches_match_mlx_lm(files, reference_tokens):
    loaded = load_model(str(files["safetensors"]), "float32")
    got, _ = run_packed_greedy(loaded, PROMPTS, STEPS)
    assert got == reference_tokens


def test_gguf_config_is_the_checkpoints(files):
    from vllm_metal.models import gguf_loader

    cfg = gguf_loader.hf_config(gguf_loader.GGUFCheckpoint(str(files["mtp"])))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "linear_num_value_heads", "linear_num_key_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                "full_attention_interval", "layer_types", "vocab_size", "tie_word_embeddings"):
        assert cfg[key] == CONFIG[key], key
    rp = cfg["rope_parameters"]
    assert rp["mrope_section"] == CONFIG["rope_parameters"]["mrope_section"]
    assert rp["partial_rotary_factor"] == CONFIG["rope_parameters"]["partial_rotary_factor"]
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"]


@pytest.mark.parametrize("name", ["f32", "mtp"])
def test_gguf_gives_the_safetensors_tokens(files, reference_tokens, name):
    st = load_model(str(files["safetensors"]), "float32")
    gg = load_model(str(files[name]), "float32")
    assert gg.hybrid.linear_layers == st.hybrid.linear_layers  # MTP layer not counted
    got, logits = run_packed_greedy(gg, PROMPTS, STEPS)
    _, want_logits = run_packed_greedy(st, PROMPTS, STEPS)
    assert got == reference_tokens
    for a, b in zip(logits, want_logits):
        np.testing.assert_allclose(np.stack(a), np.stack(b), rtol=0, atol=1e-4)


def test_block_form_value_head_reorder_equals_dense(files):
    # Q8_0: attn_qkv / attn_gate rows reordered as blocks; ssm_out (columns) dequantized
    blocks = load_model(str(files["q8"]), "float32")
    dense = load_model(str(files["q8"]), "float32", linear="mlx")
    from vllm_metal.models.gguf_linear import GGUFLinear

    gdn = blocks.model.layers[0].linear_attn
    assert isinstance(gdn.in_proj_qkv, GGUFLinear) and gdn.in_proj_qkv.is_blocks
    _, a = run_packed_greedy(blocks, PROMPTS[:2], 4)
    _, b = run_packed_greedy(dense, PROMPTS[:2], 4)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.stack(x), np.stack(y), rtol=0, atol=2e-3 * np.abs(y).max())


def test_unknown_tensor_is_refused(files):
    from vllm_metal.models import gguf_qwen35

    with pytest.raises(ValueError, match="unexpected tensor"):
        gguf_qwen35._name("blk.0.ssm_mystery.weight", 4)


def test_tied_embeddings(tmp_path):
    # Qwen3.5's small models tie the lm_head to the embeddings (block-form in a GGUF)
    tied = dict(CONFIG, tie_word_embeddings=True)
    ckpt = write_checkpoint(tmp_path / "st", seed=3, config=tied)
    want = [greedy(reference_model(ckpt), p, STEPS) for p in PROMPTS[:2]]
    gguf = write_gguf(random_model(seed=3, config=tied), tmp_path / "t.gguf", tied, qtype="Q8_0")
    dense = load_model(str(gguf), "float32", linear="mlx")
    assert dense.hf_config["tie_word_embeddings"] and "lm_head" not in dense.model.lm
    for path in (ckpt, gguf):
        got, _ = run_packed_greedy(load_model(str(path), "float32"), PROMPTS[:2], STEPS)
        if path == ckpt:
            assert got == want
        else:  # Q8_0 weights: the same tokens as the dequantized reference path
            assert got == run_packed_greedy(dense, PROMPTS[:2], STEPS)[0]
