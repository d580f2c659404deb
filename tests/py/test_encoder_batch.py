"""encoder_batch.py: an encoder's step packs whole prompts with their token types, and
refuses partial prompts; the platform refuses generation with an encoder."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_metal.encoder_batch import EncoderBatch


def test_step_packs_whole_prompts_with_token_types():
    b = EncoderBatch()
    b.add("a", [101, 7, 8, 102], None)
    pair = SimpleNamespace(extra_kwargs={"compressed_token_type_ids": (3, 6)})
    b.add("b", [101, 5, 102, 9, 9, 102], pair)
    b.add("c", [4], SimpleNamespace(extra_kwargs=None))
    s = b.step({"b": 6, "a": 4, "c": 1})
    assert s.req_ids == ["b", "a", "c"]
    np.testing.assert_array_equal(s.input_ids, [101, 5, 102, 9, 9, 102, 101, 7, 8, 102, 4])
    np.testing.assert_array_equal(s.token_type_ids, [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(s.cu_seqlens, [0, 6, 10, 11])
    np.testing.assert_array_equal(s.positions, [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0])
    b.drop(["a", "b", "c"])
    assert "a" not in b


def test_partial_or_unknown_prompts_are_refused():
    b = EncoderBatch()
    b.add("a", [1, 2, 3], None)
    with pytest.raises(ValueError, match="whole prompt"):
        b.step({"a": 2})
    with pytest.raises(ValueError, match="one step"):
        b.step({"zz": 1})


@pytest.mark.parametrize("arch", ["BertModel", "BertForMaskedLM", "XLMRobertaModel"])
def test_generation_with_an_encoder_is_refused(arch):
    # vLLM refuses --runner generate for the embedding models it knows; this covers the rest
    from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported

    ns = SimpleNamespace
    config = ns(
        cache_config=ns(prefix_caching_hash_algo="sha256", cache_dtype="auto"),
        kv_transfer_config=None, observability_config=ns(kv_cache_metrics=False),
        parallel_config=ns(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1),
        lora_config=None, speculative_config=None,
        model_config=ns(enable_prompt_embeds=False, hf_config=ns(architectures=[arch]),
                        runner_type="generate", quantization=None))
    with pytest.raises(UnsupportedConfiguration, match="--runner pooling"):
        _refuse_unsupported(config)
