"""Pipeline stages (models/pipeline_parallel.py) and the platform's refusals; the stages
serving together are in test_serving_pipeline_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from vllm_metal.models import load_model
from vllm_metal.models.pipeline_parallel import PipelineParallelError, keep_stage
from vllm_metal.models.testing import tiny_config, write_random_checkpoint
from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported, \
    _refuse_unsupported_pipeline_parallel


def test_a_stage_keeps_its_layers_and_their_cache_spec(tmp_path):
    cfg = tiny_config("ministral", num_hidden_layers=3)  # windows 7, 0, 7
    loaded = load_model(str(write_random_checkpoint(cfg, tmp_path / "ckpt")), "float32")
    stage = keep_stage(loaded, 1, 2, mx.distributed.init())
    assert (stage.start, stage.stop, stage.first, stage.last) == (2, 3, False, True)
    assert len(loaded.model.layers) == 1 and loaded.model.layers[0].self_attn.layer_idx == 0
    assert loaded.spec.num_layers == 1 and loaded.spec.sliding_window_per_layer == [7]


# Qwen3.5 with an attention layer in each half: stages of layers 0-1 and 2-3
HYBRID_CONFIG = dict(full_attention_interval=2, layer_types=["linear_attention", "full_attention"] * 2)


def test_a_hybrid_stage_keeps_its_layers_state_and_cache(tmp_path):
    from qwen3_5_checkpoint import CONFIG, write_checkpoint
    from vllm_metal import kv_plan

    ckpt = write_checkpoint(tmp_path / "q", config=dict(CONFIG, **HYBRID_CONFIG))
    loaded = load_model(str(ckpt), "float32")
    keep_stage(loaded, 1, 2, mx.distributed.init())
    model, hybrid = loaded.model, loaded.hybrid
    assert len(model.layers) == 2 and model.is_linear == [True, False]
    assert model.layers[1].self_attn.layer_idx == 1  # its KV cache: the stage's second layer
    # global indices: vLLM's layer names of this stage's layers only
    assert (hybrid.attention_layers, hybrid.linear_layers, hybrid.first_layer) == ([3], [2], 2)
    assert [s.kind for s in kv_plan.layer_specs(loaded)] == ["linear_attention", "full_attention"]
    pools = model.make_state_pools(2, mx.float32)
    assert pools[0] is not None and pools[1] is None


def test_a_hybrid_stage_without_an_attention_layer_is_refused(tmp_path):
    from qwen3_5_checkpoint import write_checkpoint  # layers: 3 linear, then 1 full

    loaded = load_model(str(write_checkpoint(tmp_path / "q")), "float32")
    with pytest.raises(PipelineParallelError, match="holds no full-attention layer.*VLLM_PP_LAYER_PARTITION"):
        keep_stage(loaded, 0, 2, mx.distributed.init())


@pytest.mark.parametrize("name, size, words", [
    ("gemma3", 2, "gemma3_text is not supported with pipeline parallelism"),
    ("llama", 4, "--pipeline-parallel-size 4 exceeds the model's 3 layers"),
])
def test_models_the_stages_cannot_split_are_refused(tmp_path, name, size, words):
    loaded = load_model(str(write_random_checkpoint(tiny_config(name), tmp_path / "ckpt")), "float32")
    with pytest.raises(PipelineParallelError, match=words):
        keep_stage(loaded, 0, size, mx.distributed.init())


def _config(size=2, *, tp=1, async_scheduling=False, layers=4, speculative=None, lora=None,
            runner="generate", archs=("LlamaForCausalLM",)):
    model = SimpleNamespace(runner_type=runner, hf_config=SimpleNamespace(architectures=list(archs)),
                            hf_text_config=SimpleNamespace(num_hidden_layers=layers))
    return SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=size, tensor_parallel_size=tp,
                                        data_parallel_size=1, world_size=size * tp,
                                        distributed_executor_backend="mp"),
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        speculative_config=speculative, lora_config=lora, model_config=model)


def test_pipeline_parallel_configuration_passes():
    _refuse_unsupported_pipeline_parallel(_config())
    _refuse_unsupported_pipeline_parallel(_config(async_scheduling=True))
    _refuse_unsupported_pipeline_parallel(_config(archs=("Qwen3_5ForCausalLM",)))  # hybrid: split by layers


def test_pipeline_parallel_keeps_async_scheduling_on_as_vllm_decides(monkeypatch):
    """Through vLLM's own argument handling (the platform's check_and_update_config
    included): async scheduling on by default, on when asked, off when refused; vLLM then
    keeps one more batch in flight than there are stages. Under the V1 runner contract vLLM
    itself turns it off, or refuses it when asked."""
    from test_data_parallel_config import engine_config, smollm2_dir

    model = smollm2_dir()
    for kw, on in [({}, True), ({"async_scheduling": True}, True), ({"async_scheduling": False}, False)]:
        config = engine_config(model, pipeline_parallel_size=2, **kw)
        assert config.scheduler_config.async_scheduling is on
        assert config.scheduler_config.scheduler_cls.endswith("MetalAsyncScheduler" if on else ".MetalScheduler")
        assert config.max_concurrent_batches == (3 if on else 2)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert engine_config(model, pipeline_parallel_size=2).scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="not supported by the V1 model runner with pipeline parallelism"):
        engine_config(model, pipeline_parallel_size=2, async_scheduling=True)


@pytest.mark.parametrize("kw, words", [
    (dict(layers=1), "exceeds the model's 1 layers"),
    (dict(speculative=SimpleNamespace(method="ngram")), r"with speculative decoding \(ngram\)"),
    (dict(runner="pooling"), "with --runner pooling"),
])
def test_unsupported_pipeline_parallel_configurations_are_refused(kw, words):
    with pytest.raises(UnsupportedConfiguration, match=words):
        _refuse_unsupported_pipeline_parallel(_config(**kw))


def test_tensor_and_pipeline_parallel_together_are_refused():
    config = _config(tp=2)
    config.cache_config = SimpleNamespace(prefix_caching_hash_algo="sha256")
    config.kv_transfer_config = None
    config.observability_config = SimpleNamespace(kv_cache_metrics=False)
    with pytest.raises(UnsupportedConfiguration, match="tensor and pipeline parallelism together"):
        _refuse_unsupported(config)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_data_parallel_with_tensor_or_pipeline_parallel_is_refused(tp, pp):
    config = _config(pp, tp=tp)
    config.parallel_config.data_parallel_size = 2
    config.cache_config = SimpleNamespace(prefix_caching_hash_algo="sha256")
    config.kv_transfer_config = None
    config.observability_config = SimpleNamespace(kv_cache_metrics=False)
    with pytest.raises(UnsupportedConfiguration,
                       match="data parallelism together with tensor or pipeline parallelism"):
        _refuse_unsupported(config)
