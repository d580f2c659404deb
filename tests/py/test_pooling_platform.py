"""The platform's startup checks for --runner pooling (platform.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported_pooling


def _config(archs=("Qwen3ForCausalLM",), *, seq="LAST", tok="ALL", async_scheduling=False,
            prefix_caching=False, embedding_size=64, speculative=None, chunked_prefill=False,
            max_model_len=512, model_type="bert"):
    hf = SimpleNamespace(model_type=model_type, max_position_embeddings=514, pad_token_id=1)
    model = SimpleNamespace(pooler_config=SimpleNamespace(seq_pooling_type=seq, tok_pooling_type=tok),
                            embedding_size=embedding_size, get_hidden_size=lambda: 64, hf_config=hf,
                            max_model_len=max_model_len)
    return SimpleNamespace(model_config=model, speculative_config=speculative,
                           scheduler_config=SimpleNamespace(async_scheduling=async_scheduling,
                                                            enable_chunked_prefill=chunked_prefill),
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching)), set(archs)


def test_served_pooling_configurations_pass():
    _refuse_unsupported_pooling(*_config())
    _refuse_unsupported_pooling(*_config(("Qwen3ForSequenceClassification",)))
    _refuse_unsupported_pooling(*_config(seq="MEAN"))
    _refuse_unsupported_pooling(*_config(prefix_caching=True))  # LAST: a hit still computes the last token
    _refuse_unsupported_pooling(*_config(("BertModel",), seq="MEAN"))  # encoders (models/bert.py)
    _refuse_unsupported_pooling(*_config(("BertForSequenceClassification",), seq="CLS"))
    _refuse_unsupported_pooling(*_config(("XLMRobertaModel",), model_type="xlm-roberta", max_model_len=512))
    _refuse_unsupported_pooling(*_config(embedding_size=32))  # Dense layers: vLLM's projector (pooling.py)
    # EmbeddingGemma: inputs past its sliding window (windowed varlen_attention), up to its positions
    _refuse_unsupported_pooling(*_gemma(max_model_len=2048))


def _gemma(max_model_len=257, bidirectional=True):
    vllm_config, archs = _config(("Gemma3TextModel",), seq="MEAN", max_model_len=max_model_len)
    hf = vllm_config.model_config.hf_config
    hf.architectures, hf.sliding_window, hf.max_position_embeddings = ["Gemma3TextModel"], 257, 2048
    hf.use_bidirectional_attention = bidirectional
    return vllm_config, archs


@pytest.mark.parametrize("kw, words", [(dict(max_model_len=2049), "--max-model-len 2048"),
                                       (dict(bidirectional=False), "use_bidirectional_attention")])
def test_embeddinggemma_limits_are_refused(kw, words):
    with pytest.raises(UnsupportedConfiguration, match=words):
        _refuse_unsupported_pooling(*_gemma(**kw))


@pytest.mark.parametrize("kw, words", [
    (dict(archs=("Qwen3_5ForCausalLM",)), "architecture"),
    (dict(archs=("GPT2Model",)), "architecture"),
    (dict(archs=("BertModel",), chunked_prefill=True), "chunked prefill"),
    # XLM-R's positions start at padding_idx + 1: 514 entries hold 512 tokens
    (dict(archs=("XLMRobertaModel",), model_type="xlm-roberta", max_model_len=514), "--max-model-len 512"),
    (dict(async_scheduling=True), "async"),
    (dict(tok="STEP"), "STEP"),
    (dict(seq="MEAN", prefix_caching=True), "prefix caching"),
    (dict(seq="CLS", prefix_caching=True), "prefix caching"),
    (dict(speculative=object()), "speculative"),
])
def test_unsupported_pooling_configurations_are_refused(kw, words):
    with pytest.raises(UnsupportedConfiguration, match=words):
        _refuse_unsupported_pooling(*_config(**kw))


@pytest.mark.parametrize("pooling, want", [("MEAN", "MEAN"), ("CLS", "CLS"), ("LAST", "LAST")])
def test_gguf_pooling_type_reaches_vllm_pooler_config(tmp_path, pooling, want):
    """models/gguf_dir.py writes an embedding file's pooling as sentence-transformers
    modules; vLLM's own reader turns them into the pooler config, normalised."""
    from vllm.transformers_utils.config import get_pooling_config

    from vllm_metal.models import prepare_gguf_dir
    from vllm_metal.models.testing import tiny_config, write_tiny_gguf

    path = tmp_path / "e.gguf"
    write_tiny_gguf(tiny_config("qwen3"), path, qtype="F32", pooling_type=pooling)
    got = get_pooling_config(prepare_gguf_dir(str(path), str(tmp_path / "dir")))
    assert got == {"use_activation": True, "seq_pooling_type": want}


def test_gguf_without_pooling_type_has_no_modules(tmp_path):
    from vllm.transformers_utils.config import get_pooling_config

    from vllm_metal.models import prepare_gguf_dir
    from vllm_metal.models.testing import tiny_config, write_tiny_gguf

    path = tmp_path / "g.gguf"
    write_tiny_gguf(tiny_config("qwen3"), path, qtype="F32")
    assert get_pooling_config(prepare_gguf_dir(str(path), str(tmp_path / "dir"))) is None


def test_gguf_reranker_file_is_refused(tmp_path):
    import json

    from vllm_metal.models import prepare_gguf_dir
    from vllm_metal.models.testing import tiny_config, write_tiny_gguf

    path = tmp_path / "r.gguf"
    write_tiny_gguf(tiny_config("qwen3"), path, qtype="F32", pooling_type="RANK")
    directory = prepare_gguf_dir(str(path), str(tmp_path / "dir"))
    config = json.loads((tmp_path / "dir" / "config.json").read_text())
    assert directory == str(tmp_path / "dir")
    vllm_config, archs = _config()
    vllm_config.model_config.hf_config.gguf_pooling_type = config["gguf_pooling_type"]
    with pytest.raises(UnsupportedConfiguration, match="GGUF reranker"):
        _refuse_unsupported_pooling(vllm_config, archs)


@pytest.mark.parametrize("fields, parameter", [
    (dict(late_interaction_params="cache_query"), "late_interaction_params"),
    (dict(step_tag_id=5), "step_tag_id"),
    (dict(returned_token_ids=[3, 4]), "step_tag_id"),
])
def test_pooling_requests_the_runner_cannot_serve_are_refused(fields, parameter):
    from vllm.exceptions import VLLMValidationError
    from vllm.pooling_params import LateInteractionParams, PoolingParams

    from vllm_metal.request_validation import validate_sampling_params

    validate_sampling_params(PoolingParams(task="embed"))  # the same request without them passes
    if "late_interaction_params" in fields:
        fields = dict(late_interaction_params=LateInteractionParams(mode=fields["late_interaction_params"],
                                                                   query_key="q"))
    with pytest.raises(VLLMValidationError, match=r"\[vllm-metal\] .* not supported") as refused:
        validate_sampling_params(PoolingParams(task="embed", **fields))
    assert refused.value.parameter == parameter
