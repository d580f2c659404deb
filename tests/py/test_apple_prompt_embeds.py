"""--enable-prompt-embeds is refused at startup, naming the flag.

The runner feeds token ids only. Without the refusal, a request with prompt_embeds
(verified with `vllm serve` of SmolLM2 on the CPU) was answered from the scheduler's
placeholder ids (all 0) under the default V2 runner contract, a wrong answer with a 200,
and killed the engine under VLLM_USE_V2_MODEL_RUNNER=0 (ValueError in execute_model).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported


def config(**model):
    model = SimpleNamespace(**{**dict(runner_type="generate", quantization=None,
                                      enable_prompt_embeds=False,
                                      hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"])),
                               **model})
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        data_parallel_size=1),
        lora_config=None, speculative_config=None, model_config=model,
        cache_config=SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        kv_transfer_config=None, observability_config=SimpleNamespace(kv_cache_metrics=False))


def test_prompt_embeds_are_refused_by_the_config_check():
    _refuse_unsupported(config())  # the same config without the flag is accepted
    with pytest.raises(UnsupportedConfiguration,
                       match=r"--enable-prompt-embeds \(prompt embeddings as input\) is not supported"):
        _refuse_unsupported(config(enable_prompt_embeds=True))


@pytest.mark.slow
@pytest.mark.serving
def test_vllm_serve_refuses_to_start_with_prompt_embeds():
    from serving_harness import Server
    from vllm_metal.models.offline import OFFLINE_GGUF

    with pytest.raises(RuntimeError, match=r"vllm serve exited") as failure:
        Server(str(OFFLINE_GGUF["smollm2"]()), "smollm2",
               ["--max-model-len", "256", "--num-gpu-blocks-override", "32", "--enable-prompt-embeds"],
               startup_timeout=300)
    assert "--enable-prompt-embeds (prompt embeddings as input) is not supported" in str(failure.value)
