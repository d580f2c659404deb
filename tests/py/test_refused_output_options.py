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


def test_every_architecture_the_loader_builds_is_served():
    """The loader's table (models/architectures.py) and the platform's allow-list agree: an
    architecture the docs list and the loader builds is not refused at startup."""
    from vllm_metal.models.architectures import ARCHITECTURES
    from vllm_metal.platform import SUPPORTED_ARCHITECTURES

    for arch in ARCHITECTURES.values():
        assert arch.hf_architecture in SUPPORTED_ARCHITECTURES, arch
        _refuse_unsupported(config(hf_config=SimpleNamespace(architectures=[arch.hf_architecture])))


@pytest.mark.parametrize("spec, named", [
    (dict(rejection_sample_method="synthetic"), "rejection_sample_method 'synthetic'"),
    (dict(draft_sample_method="probabilistic"), "draft_sample_method 'probabilistic'"),
])
def test_speculative_sampling_methods_we_do_not_run_are_refused(spec, named):
    from vllm_metal.speculative import unsupported_reason

    def vllm_config(**fields):
        return SimpleNamespace(speculative_config=SimpleNamespace(**{
            **dict(method="ngram", rejection_sample_method="standard", draft_sample_method="greedy"),
            **fields}),
            model_config=SimpleNamespace(hf_text_config=None, logits_processors=None))

    assert unsupported_reason(vllm_config()) is None
    assert named in unsupported_reason(vllm_config(**spec))


@pytest.mark.parametrize("lora, named", [
    (dict(target_modules=["o_proj"]), "--lora-target-modules"),
    (dict(lora_dtype="float32"), "--lora-dtype float32"),
])
def test_lora_options_we_do_not_honour_are_refused(lora, named):
    from vllm_metal.platform import _refuse_unsupported_lora

    def vllm_config(**fields):
        return SimpleNamespace(
            lora_config=SimpleNamespace(**{**dict(fully_sharded_loras=False, target_modules=None,
                                                  lora_dtype="float16"), **fields}),
            model_config=SimpleNamespace(dtype="float16", hf_config=SimpleNamespace(
                architectures=["LlamaForCausalLM"])))

    _refuse_unsupported_lora(vllm_config())  # auto resolved to the model's dtype: accepted
    with pytest.raises(UnsupportedConfiguration, match=named):
        _refuse_unsupported_lora(vllm_config(**lora))


def test_return_sampling_mask_is_refused():
    _refuse_unsupported(config(return_sampling_mask=False))
    with pytest.raises(UnsupportedConfiguration, match="--return-sampling-mask is not supported"):
        _refuse_unsupported(config(return_sampling_mask=True))


def test_hf_overrides_the_model_would_not_apply_are_refused():
    reranker = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                "is_original_qwen3_reranker": True}
    _refuse_unsupported(config(hf_overrides=reranker))  # applied: vLLM's config and the runner
    _refuse_unsupported(config(hf_overrides={"max_position_embeddings": 4096}))
    with pytest.raises(UnsupportedConfiguration, match=r"--hf-overrides rope_scaling \(the model is built"):
        _refuse_unsupported(config(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                                                 "max_position_embeddings": 4096}))
    with pytest.raises(UnsupportedConfiguration, match="--hf-overrides as a function"):
        _refuse_unsupported(config(hf_overrides=lambda c: c))


@pytest.mark.parametrize("flag", ["mamba_cache_dtype", "mamba_ssm_cache_dtype"])
def test_hybrid_state_dtypes_other_than_auto_are_refused(flag):
    hybrid = dict(hf_config=SimpleNamespace(architectures=["Qwen3_5ForCausalLM"]))
    cache = SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256",
                            mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto")
    _refuse_unsupported(config(dict(cache_config=cache), **hybrid))
    cache = SimpleNamespace(**{**vars(cache), flag: "float16"})
    _refuse_unsupported(config(dict(cache_config=cache)))  # a model without that state: moot
    with pytest.raises(UnsupportedConfiguration, match=f"--{flag.replace('_', '-')} float16 is not supported"):
        _refuse_unsupported(config(dict(cache_config=cache), **hybrid))
