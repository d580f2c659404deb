"""GGUF checkpoints: tiny files written with the gguf package the way
llama.cpp's converter lays them out (llama Q/K rows permuted, gemma norms
stored as 1 + w, weights of every supported type) load with their matrices in
block form (GGUFLinear / GGUFEmbedding on ops.gguf_matmul) into models equal to
mlx-lm's on the dense weights they encode, within the per-type bound of
testing.GGUF_LOGITS_TOLERANCE; prepare_gguf_dir makes a directory transformers
reads."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import mlx.core as mx

from vllm_metal import ops
from vllm_metal.models import gguf_dir, gguf_loader, load_model, prepare_gguf_dir
from vllm_metal.models.gguf_linear import GGUFEmbedding, GGUFLinear
from vllm_metal.models.testing import (GGUF_LOGITS_TOLERANCE, gguf_logits_tolerance,
                                       gguf_parity_config, gguf_parity_error, run_packed,
                                       uses_8bit_activations,
                                       tiny_config, write_tiny_gguf)

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _gguf_config(name):
    if name == "llama_untied_bias":
        return tiny_config("llama", tie_word_embeddings=False, attention_bias=True)
    cfg = tiny_config(name)
    if name == "gemma3":
        # GGUF has no query_pre_attn_scalar: llama.cpp scales by 1/sqrt(head_dim).
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    return cfg


@pytest.mark.parametrize("int8", [False, True], ids=["float_activations", "int8_activations"])
@pytest.mark.parametrize("name", ["llama", "llama_untied_bias", "qwen2", "qwen3", "gemma3"])
def test_gguf_model_matches_mlx_lm_on_the_dense_weights(tmp_path, name, int8):
    """Every architecture (Q4_K, 256-weight blocks)."""
    err = gguf_parity_error(name, "Q4_K", tmp_path, int8_activations=int8)
    assert err <= gguf_logits_tolerance("Q4_K", int8), err


@pytest.mark.parametrize("qtype", sorted(set(GGUF_LOGITS_TOLERANCE) - {"Q4_K"}))
def test_every_gguf_type_matches_mlx_lm_on_the_dense_weights(tmp_path, qtype):
    """llama with attention bias: permuted Q/K rows (and biases) of every type,
    un-permuted as whole rows of blocks; untied lm_head. Float32 activations
    (the default) for every type, and 8-bit ones for the types that have them."""
    err = gguf_parity_error("llama_untied_bias", qtype, tmp_path)
    assert err <= gguf_logits_tolerance(qtype), err
    if uses_8bit_activations(qtype):
        err = gguf_parity_error("llama_untied_bias", qtype, tmp_path, int8_activations=True)
        assert err <= gguf_logits_tolerance(qtype, True), err


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "F16"])
def test_weights_stay_in_block_form(tmp_path, qtype):
    """Matrices are the file's bytes as they are (uint8 blocks), llama's Q/K with
    their rows reordered; they decode exactly to the reference path's dense
    (un-permuted) weights. The tied lm_head is the token_embd blocks."""
    cfg = gguf_parity_config("llama")  # tied
    path = tmp_path / "m.gguf"
    write_tiny_gguf(cfg, path, seed=3, qtype=qtype)
    blocks = load_model(str(path), "float32")
    dense = load_model(str(path), "float32", linear="mlx")
    ckpt = gguf_loader.GGUFCheckpoint(str(path))
    b_layer, d_layer = blocks.model.layers[1], dense.model.layers[1]

    def file_bytes(name):
        return np.array(ckpt._core_file.tensor_data(name))

    embed = blocks.model.lm.model.embed_tokens
    assert isinstance(embed, GGUFEmbedding) and embed.is_blocks and "lm_head" not in blocks.model.lm
    np.testing.assert_array_equal(np.array(embed.weight), file_bytes("token_embd.weight"))
    for name, gname in (("mlp.gate_proj", "ffn_gate"), ("mlp.down_proj", "ffn_down"),
                        ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output")):
        m = b_layer[name.split(".")[0]][name.split(".")[1]]
        assert isinstance(m, GGUFLinear) and m.weight.dtype == mx.uint8, name
        np.testing.assert_array_equal(np.array(m.weight), file_bytes(f"blk.1.{gname}.weight"))
    q = np.array(b_layer.self_attn.q_proj.weight)
    assert q.shape == file_bytes("blk.1.attn_q.weight").shape
    assert not np.array_equal(q, file_bytes("blk.1.attn_q.weight"))  # rows reordered
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        b, d = b_layer.self_attn[name], d_layer.self_attn[name]
        got = ops.gguf_dequantize(b.weight, b.qtype, [b.out_features, b.in_features])
        np.testing.assert_array_equal(np.array(got), np.array(d.weight), err_msg=name)


def test_block_embedding_looks_up_rows_and_is_the_tied_lm_head(tmp_path):
    cfg = gguf_parity_config("qwen2")  # tied
    path = tmp_path / "m.gguf"
    write_tiny_gguf(cfg, path, seed=5, qtype="Q8_0")
    ours = load_model(str(path), "bfloat16", int8_activations=True)
    embed = ours.model.lm.model.embed_tokens
    table = np.array(gguf_loader.GGUFCheckpoint(str(path)).dense("token_embd.weight"))
    ids = mx.array(np.array([[7, 0, 299], [5, 5, 1]], np.int32))
    rows = embed(ids)
    assert rows.dtype == mx.bfloat16 and rows.shape == (2, 3, cfg["hidden_size"])
    want = mx.array(table[np.array(ids)]).astype(mx.bfloat16)  # dequantized, then rounded once
    np.testing.assert_array_equal(np.array(rows.astype(mx.float32)), np.array(want.astype(mx.float32)))
    assert embed(mx.zeros((0,), mx.int32)).shape == (0, cfg["hidden_size"])
    x = mx.array(np.random.default_rng(0).standard_normal((12, cfg["hidden_size"])), mx.float32)
    got = np.array(embed.as_linear(x))  # Q8_0: x rounded to 8-bit blocks of 32 first
    np.testing.assert_allclose(got, _round_to_8bit_blocks(np.array(x)) @ table.T, rtol=1e-4, atol=1e-4)
    embed.exact = True
    np.testing.assert_allclose(np.array(embed.as_linear(x)), np.array(x) @ table.T, rtol=1e-4, atol=1e-4)


def _round_to_8bit_blocks(x: np.ndarray) -> np.ndarray:
    """llama.cpp's activation rounding: per 32 values d = max|x| / 127, q = rint(x / d)."""
    b = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(b).max(-1, keepdims=True)
    q = np.rint(b * np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0))
    return (q * (amax / np.float32(127))).reshape(x.shape)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_config_from_gguf_metadata(tmp_path, name):
    cfg = _gguf_config(name)
    write_tiny_gguf(cfg, tmp_path / "m.gguf")
    ckpt = gguf_loader.GGUFCheckpoint(str(tmp_path / "m.gguf"))
    got = gguf_loader.hf_config(ckpt)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size", "rope_theta",
                "max_position_embeddings", "bos_token_id", "eos_token_id", "architectures"):
        assert got[key] == cfg[key], key
    assert got["rms_norm_eps"] == pytest.approx(cfg["rms_norm_eps"])
    assert got["head_dim"] == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert got["tie_word_embeddings"] == cfg["tie_word_embeddings"]
    if name == "gemma3":
        assert got["sliding_window"] == 5 and got["sliding_window_pattern"] == 2
        assert got["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
        assert got["query_pre_attn_scalar"] == cfg["head_dim"]


def test_numpy_dequantizer_agrees_with_ours(tmp_path, monkeypatch):
    cfg = _gguf_config("llama")
    write_tiny_gguf(cfg, tmp_path / "m.gguf", qtype="Q4_1")
    ours = gguf_loader.GGUFCheckpoint(str(tmp_path / "m.gguf"))
    core = gguf_loader._core_module()

    class CoreWithoutKernels:  # our reader, but no type our kernels decode
        def __getattr__(self, name):
            return getattr(core, name)

        def gguf_type_info(self, type_id):
            return (*core.gguf_type_info(type_id)[:3], False)

    monkeypatch.setattr(gguf_loader, "_core_module", CoreWithoutKernels)
    numpy_dequant = gguf_loader.GGUFCheckpoint(str(tmp_path / "m.gguf"))
    monkeypatch.setattr(gguf_loader, "_core_module", lambda: None)
    gguf_package = gguf_loader.GGUFCheckpoint(str(tmp_path / "m.gguf"))  # gguf's reader too
    assert gguf_package.metadata["llama.block_count"] == ours.metadata["llama.block_count"]
    assert gguf_package.metadata["tokenizer.ggml.merges"] == ours.metadata["tokenizer.ggml.merges"]
    assert ours.tensors == gguf_package.tensors
    for name in ours.tensors:
        want = np.array(ours.dense(name))
        np.testing.assert_array_equal(np.array(numpy_dequant.dense(name)), want)
        np.testing.assert_array_equal(np.array(gguf_package.dense(name)), want)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    back = gguf_loader.unpermute_rows(mx.array(gguf_loader.permute_rows(w, 6)), 6)
    np.testing.assert_array_equal(np.array(back), w)
    # Head 0 of the GGUF layout interleaves its two halves: rows 0, 4, 1, 5, ...
    np.testing.assert_array_equal(gguf_loader.permute_rows(w, 6)[:4, 0], w[[0, 4, 1, 5], 0])


def test_default_dtypes(tmp_path):
    write_tiny_gguf(_gguf_config("llama"), tmp_path / "q.gguf", qtype="Q8_0")
    write_tiny_gguf(_gguf_config("llama"), tmp_path / "f.gguf", qtype="F32")
    write_tiny_gguf(_gguf_config("gemma3"), tmp_path / "g.gguf", qtype="Q8_0")
    assert load_model(str(tmp_path / "q.gguf")).spec.dtype == "float16"
    assert load_model(str(tmp_path / "f.gguf")).spec.dtype == "float32"
    assert load_model(str(tmp_path / "g.gguf")).spec.dtype == "bfloat16"
    assert load_model(str(tmp_path / "q.gguf"), "bfloat16").spec.dtype == "bfloat16"


def test_prepare_gguf_dir_is_readable_by_transformers(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    cfg = _gguf_config("llama")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(cfg, path, chat_template=CHAT_TEMPLATE)
    out = prepare_gguf_dir(str(path), str(tmp_path / "prepared"))
    names = {p.name for p in (tmp_path / "prepared").iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.gguf"} <= names
    assert (tmp_path / "prepared" / "model.gguf").resolve() == path.resolve()

    hf_cfg = AutoConfig.from_pretrained(out)
    assert hf_cfg.model_type == "llama" and hf_cfg.architectures == ["LlamaForCausalLM"]
    assert hf_cfg.num_key_value_heads == cfg["num_key_value_heads"]
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("the capital of France").input_ids
    assert tok.decode(ids) == "the capital of France"
    assert tok.convert_ids_to_tokens(tok(" Paris").input_ids) == ["ĠParis"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((tmp_path / "prepared" / "generation_config.json").read_text())["eos_token_id"] == 2

    # The directory loads like the file.
    a = load_model(out, "float32")
    b = load_model(str(path), "float32")
    seq = [[5, 6, 7, 8, 9]]
    np.testing.assert_array_equal(run_packed(a, seq, [[5]])[0], run_packed(b, seq, [[5]])[0])


def test_prepare_gguf_dir_is_cached_and_builds_once_under_concurrency(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(_gguf_config("qwen3"), path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    builds = []
    real_write = gguf_dir._write_dir

    def counting_write(src, out):
        builds.append(src)
        real_write(src, out)

    monkeypatch.setattr(gguf_dir, "_write_dir", counting_write)
    results = []
    threads = [threading.Thread(target=lambda: results.append(prepare_gguf_dir(str(path))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert len(set(results)) == 1
    assert results[0].startswith(str(tmp_path / "cache" / "vllm_metal" / "gguf"))
    assert prepare_gguf_dir(str(path)) == results[0] and len(builds) == 1
    leftovers = [p for p in (tmp_path / "cache" / "vllm_metal" / "gguf").iterdir() if ".tmp" in p.name]
    assert leftovers == []


def test_gemma_fallback_chat_template():
    import jinja2

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital?"}]
    text = jinja2.Environment().from_string(gguf_dir.GEMMA_CHAT_TEMPLATE).render(
        bos_token="<bos>", messages=messages, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nCapital?<end_of_turn>\n<start_of_turn>model\n")
