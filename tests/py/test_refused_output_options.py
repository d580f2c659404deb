"""vLLM options that change what a request's output is, and that the runner does not do, are
refused at startup naming the option (docs/serving.md, "Refused at startup"): served anyway,
each would answer as if it were off, e.g. text the user believes watermarked that is not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported


def config(vllm=None, **model):
    model = SimpleNamespace(**{**dict(runner_type="generate", quantization=None,
                                      hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"])),
                               **model})
    return SimpleNamespace(**{**dict(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        data_parallel_size=1),
        lora_config=None, speculative_config=None, model_config=model,
        cache_config=SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        kv_transfer_config=None, observability_config=SimpleNamespace(kv_cache_metrics=False),
        watermark_config=None, diffusion_config=None,
        aux_output_config=SimpleNamespace(enable_return_routed_experts=False)), **(vllm or {})})


@pytest.mark.parametrize("vllm, model, named", [
    (dict(watermark_config=SimpleNamespace(key=1)), {}, "--watermark-config"),
    ({}, dict(enable_trace_replay=True), "--enable-trace-replay"),
    (dict(aux_output_config=SimpleNamespace(enable_return_routed_experts=True)), {},
     "--enable-return-routed-experts"),
    (dict(diffusion_config=SimpleNamespace(canvas_length=8)), {}, "--diffusion-config"),
])
def test_each_option_is_refused_by_name(vllm, model, named):
    _refuse_unsupported(config())  # the same config without the option is accepted
    with pytest.raises(UnsupportedConfiguration, match=f"{named}.* is not supported"):
        _refuse_unsupported(config(vllm, **model))


@pytest.mark.slow
@pytest.mark.serving
def test_vllm_serve_refuses_to_start_with_a_watermark():
    from serving_harness import Server
    from vllm_metal.models.offline import OFFLINE_GGUF

    with pytest.raises(RuntimeError, match=r"vllm serve exited") as failure:
        Server(str(OFFLINE_GGUF["smollm2"]()), "smollm2",
               ["--max-model-len", "256", "--num-gpu-blocks-override", "32",
                "--watermark-config", '{"key": 7}'], startup_timeout=300)
    assert "--watermark-config (watermarked sampling) is not supported" in str(failure.value)
