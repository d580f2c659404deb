"""MetalPlatform: how vLLM 0.33 sees this plugin.

vLLM keeps its API server, scheduler and KV-cache manager; this platform points
it at our worker (vllm_metal.worker.MetalWorker), runs it in-process, and
refuses at startup what the runner does not support. All config edits live in
check_and_update_config.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import psutil
import torch
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_metal.log import get_logger
# encoders: --runner pooling only, no KV cache (models/bert.py, encoder_batch.py)
from vllm_metal.models.encoder_archs import ENCODER_ARCHITECTURES, GEMMA3_ENCODER_ARCHITECTURES

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)

# The attention backend vLLM's selector sees. Our runner never builds vLLM's
# attention layers; the class only answers capability questions.
ATTENTION_BACKEND = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MinistralForCausalLM",
    "Ministral3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",  # sparse MoE MLPs on ops.fused_moe (models/moe.py)
    "OlmoeForCausalLM",  # the same, q/k norms over the whole projection
    "GptOssForCausalLM",  # attention sinks; MoE with biases, clamped SwiGLU (models/gpt_oss.py)
    "Gemma3ForCausalLM",
    "Qwen3_5ForCausalLM",  # hybrid: gated delta net + attention (hybrid.py)
    "Qwen3_5ForConditionalGeneration",  # the same, text-only (vision tower not loaded)
    "Qwen3_5MoeForCausalLM",  # Qwen3.5 with MoE MLPs on ops.fused_moe (models/moe.py)
    "Qwen3_5MoeForConditionalGeneration",  # the same, text-only
}
# hybrid (per-request state): generate runner only
HYBRID_ARCHITECTURES = {"Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                        "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"}

# --additional-config moe_expert_offload: MoE models whose experts stream (models/expert_offload.py)
STREAMED_MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM",
                              "Qwen3_5MoeForConditionalGeneration", "OlmoeForCausalLM",
                              "GptOssForCausalLM"}

# --runner pooling only: the decoder body plus a score layer (pooling.py)
SEQUENCE_CLASSIFIERS = {
    "LlamaForSequenceClassification",
    "MistralForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
}



def _draft_model_resolved(parse):
    """--speculative-config's JSON parser, then its "model" (a draft model) resolved as the
    model argument is: a .gguf file or owner/repo:TAG becomes a prepared directory."""
    from vllm_metal.model_paths import resolve_model_argument

    def parse_speculative_config(text):
        config = parse(text)
        if isinstance(config, dict) and isinstance(config.get("model"), str):
            config["model"] = resolve_model_argument(config["model"])
        return config

    return parse_speculative_config

class UnsupportedConfiguration(ValueError):
    """Raised at startup for settings the Metal runner does not support."""


# vLLM's prefix-caching hash algorithms and their digest bytes: the C++ block pool
# keys on the first 16 (kv_cache_manager.py), so every one of these qualifies.
PREFIX_CACHE_HASH_DIGEST_BYTES = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}


def _refuse(what: str, hint: str = "") -> None:
    raise UnsupportedConfiguration(f"[vllm-metal] {what} is not supported" + (f"; {hint}" if hint else ""))


class MetalPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    ray_device_key: str = ""

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "Apple Silicon (Metal)" if _on_apple() else "CPU (vllm-metal)"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        # on Apple, what Metal lets the GPU keep resident, not all of the unified memory
        return metal_working_set() or psutil.virtual_memory().total

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None

    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's base class imports vllm._C (its CUDA or CPU custom ops) and warns when it
        # is absent, as in PyPI's Linux wheel. Nothing here calls those ops: our kernels
        # come with vllm_metal._core, loaded when the worker builds the model.
        try:
            import vllm._C  # noqa: F401
        except ImportError:
            logger.debug("vllm._C is not installed; vllm-metal does not use vLLM's custom ops")
        with contextlib.suppress(ImportError):
            import vllm._moe_C_stable_libtorch  # noqa: F401

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        return ATTENTION_BACKEND

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: VllmConfig) -> None:
        # Our kernels take any block size: keep the user's or vLLM's default, except
        # for hybrid models, whose attention page must hold a request's state page.
        from vllm_metal.hybrid import align_block_size, is_hybrid_config

        model = vllm_config.model_config
        if model is not None and is_hybrid_config(model.hf_text_config):
            align_block_size(vllm_config)

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # vLLM's hybrid KV-cache manager (one group per layer kind): needed for models
        # with linear-attention layers (hybrid.py). Attention-only models still get one
        # group: sliding-window layers are declared as full attention.
        return True

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(psutil.Process().memory_info().rss)

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        # `vllm serve model.gguf`: the model argument resolves to a directory
        # prepared from the file's metadata (config.json, tokenizer), which
        # vLLM's front end reads like any local checkpoint.
        if parser is None:
            return
        from vllm_metal.model_paths import (name_models_as_given, resolve_model_argument,
                                            resolve_served_model)

        if not getattr(parser, "_vllm_metal_names_models", False):
            # argparse hands a subcommand's arguments to the subparser's parse_known_args
            parse_known_args = parser.parse_known_args

            def parse_naming_models(args=None, namespace=None):
                namespace, rest = parse_known_args(args, namespace)
                name_models_as_given(namespace)
                return namespace, rest

            parser.parse_known_args = parse_naming_models
            parser._vllm_metal_names_models = True
        for action in parser._actions:
            if action.dest in ("model_tag", "model"):
                action.type = resolve_served_model
            elif action.dest == "tokenizer":
                action.type = resolve_model_argument
            elif action.dest == "speculative_config" and action.type is not None:
                action.type = _draft_model_resolved(action.type)
            elif action.dest == "middleware":
                # a 503 (not vLLM's 500) for requests that arrive during a SIGTERM
                # drain; --middleware given by the user appends to this list
                ours = "vllm_metal.drain_refusal.DrainRefusal"
                if ours not in (action.default or []):
                    action.default = [*(action.default or []), ours]

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode
        from vllm.config.compilation import CUDAGraphMode

        _refuse_unsupported(vllm_config)
        _use_core_kv_cache_manager(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = "vllm_metal.worker.MetalWorker"
        # one process drives the device; with tensor or pipeline parallelism vLLM's
        # multiprocessing executor runs one worker per rank (control on gloo, tensors on
        # MLX's ring). Data parallelism is vLLM's replicas, one engine process each.
        parallel.distributed_executor_backend = "mp" if parallel.world_size > 1 else "uni"
        parallel.disable_custom_all_reduce = True
        from vllm_metal.data_parallel import share_memory_between_replicas

        share_memory_between_replicas(vllm_config)
        # async scheduling (vLLM's default; --no-async-scheduling turns it off) overlaps
        # the host's work on a step with the forward of the one before (model_runner.py)
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        cache = vllm_config.cache_config
        if cache.block_size is None:
            cache.block_size = 16
        from vllm_metal.hybrid import configure_prefix_caching, is_hybrid_config

        if vllm_config.model_config is not None and is_hybrid_config(vllm_config.model_config.hf_text_config):
            configure_prefix_caching(vllm_config)
        _name_gguf_models_after_their_file(vllm_config)
        if "moe_expert_offload" in (getattr(vllm_config, "additional_config", None) or {}):
            from vllm_metal.expert_metrics import prepare

            prepare(vllm_config)  # the cache's counters on /metrics

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        from vllm_metal.request_validation import validate_sampling_params

        validate_sampling_params(params)


def _name_gguf_models_after_their_file(vllm_config: VllmConfig) -> None:
    """A GGUF served from its prepared directory keeps the file's path as its
    model name, so clients ask for what they passed to `vllm serve`."""
    from vllm_metal.model_paths import gguf_source_of

    model = vllm_config.model_config
    if model is None:
        return
    source = gguf_source_of(model.model)
    if source and model.served_model_name in (model.model, None):
        model.served_model_name = source


def metal_working_set() -> int | None:
    """Bytes Metal recommends the GPU keep resident (MTLDevice.recommendedMaxWorkingSetSize,
    about 2/3 to 3/4 of the unified memory), as MLX reports it; None without a Metal GPU."""
    import mlx.core as mx

    if not mx.metal.is_available():
        return None
    return int(mx.device_info(mx.gpu)["max_recommended_working_set_size"])


def _on_apple() -> bool:
    import platform

    return platform.system() == "Darwin" and platform.machine() == "arm64"


def _use_core_kv_cache_manager(vllm_config: VllmConfig) -> None:
    """vLLM's scheduler with the C++ runtime's KV-cache manager (scheduler.py),
    unless the user named a scheduler class of their own."""
    sched = vllm_config.scheduler_config
    if _is_encoder(vllm_config):
        return  # no KV cache (attention-free to vLLM): its own scheduler needs no blocks
    if sched.scheduler_cls is None:
        name = "MetalAsyncScheduler" if sched.async_scheduling else "MetalScheduler"
        sched.scheduler_cls = f"vllm_metal.scheduler.{name}"


def _is_encoder(vllm_config: VllmConfig) -> bool:
    model = vllm_config.model_config
    archs = set(getattr(model.hf_config, "architectures", None) or []) if model is not None else set()
    return bool(archs & ENCODER_ARCHITECTURES)


def _refuse_unsupported_kv_cache(vllm_config: VllmConfig) -> None:
    """What the C++ KV-cache manager does not do (kv_cache_manager.py)."""
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo not in PREFIX_CACHE_HASH_DIGEST_BYTES:
        _refuse(f"--prefix-caching-hash-algo {algo}",
                f"supported: {', '.join(PREFIX_CACHE_HASH_DIGEST_BYTES)}")
    if vllm_config.kv_transfer_config is not None:
        _refuse("KV connectors (--kv-transfer-config)")
    if vllm_config.observability_config.kv_cache_metrics:
        _refuse("--kv-cache-metrics (block residency sampling)")


def _refuse_unsupported_lora(vllm_config: VllmConfig) -> None:
    """LoRA runs on the llama-family / qwen3 and Qwen3.5 paged models (vllm_metal/lora), MoE
    ones included (routed experts per op in steps with their adapters: lora/experts.py),
    generating or pooling (decoder embedders and classifiers), with every speculative
    method: the verify step is a packed step like any other, each row with its sequence's
    adapter, so outputs are exact; a drafting model or head drafts without the adapter
    (fewer drafts kept for an adapter far from the base). Not on the encoders (other
    model classes, and adapters on layers a model lacks, are refused when the runner
    installs them: lora/manager.py)."""
    model = vllm_config.model_config
    archs = set(getattr(getattr(model, "hf_config", None), "architectures", None) or [])
    if archs & ENCODER_ARCHITECTURES:
        _refuse(f"LoRA with the encoder {sorted(archs)}",
                "adapters apply to decoder models (embedders such as Qwen3-Embedding too)")
    lora = vllm_config.lora_config
    if getattr(lora, "fully_sharded_loras", False):
        _refuse("--fully-sharded-loras")
    if getattr(lora, "target_modules", None):
        _refuse("--lora-target-modules", "an adapter applies to every module it holds weights for")
    lora_dtype = getattr(lora, "lora_dtype", None)
    if lora_dtype not in (None, "auto", getattr(model, "dtype", None)):
        _refuse(f"--lora-dtype {str(lora_dtype).removeprefix('torch.')}",
                "adapters run in the model's dtype (auto)")


def _refuse_parallel_features(vllm_config: VllmConfig, what: str, speculation=(),
                              lora: bool = False) -> None:
    """Features neither tensor nor pipeline parallelism carries yet; `speculation`: the
    speculative methods `what` does carry; `lora`: whether it carries LoRA."""
    spec = vllm_config.speculative_config
    if spec is not None and spec.method not in speculation:
        _refuse(f"{what} with speculative decoding ({spec.method})",
                f"supported: {', '.join(speculation)}" if speculation else "")
    if vllm_config.lora_config is not None and not lora:
        _refuse(f"{what} with LoRA (--enable-lora)", "--pipeline-parallel-size carries it")
    model = vllm_config.model_config
    if model is None:
        return
    if model.runner_type == "pooling":
        _refuse(f"{what} with --runner pooling")


def _refuse_unsupported_pipeline_parallel(vllm_config: VllmConfig) -> None:
    """What pipeline parallelism (models/pipeline_parallel.py) does not carry yet; a model
    the stages cannot split (gemma3, fewer layers than stages) is refused at load."""
    size = vllm_config.parallel_config.pipeline_parallel_size
    what = f"--pipeline-parallel-size {size}"
    # async scheduling (vLLM's default) works: the last stage sends the sampled tokens back
    # itself (models/pipeline_parallel.py). vLLM keeps it off under the V1 runner contract
    # (VLLM_USE_V2_MODEL_RUNNER=0), whose scheduler does not stagger a request's decodes.
    # LoRA: each stage applies the adapters of its own layers (lora/manager.py)
    _refuse_parallel_features(vllm_config, what, lora=True)
    model = vllm_config.model_config
    layers = getattr(model.hf_text_config, "num_hidden_layers", None) if model is not None else None
    if layers is not None and layers < size:
        raise UnsupportedConfiguration(f"[vllm-metal] {what} exceeds the model's {layers} layers")


def _refuse_unusable_distributed_backend() -> None:
    """VLLM_METAL_DISTRIBUTED_BACKEND (the workers' MLX group, mlx_ring.py): a known name that
    this MLX build can run (JACCL needs RDMA over Thunderbolt; not on Linux)."""
    from vllm_metal import envs
    from vllm_metal.mlx_ring import backend_problem

    try:
        backend = envs.VLLM_METAL_DISTRIBUTED_BACKEND
    except ValueError as e:
        raise UnsupportedConfiguration(f"[vllm-metal] {e}") from None
    if problem := backend_problem(backend):
        raise UnsupportedConfiguration(problem)


def _refuse_unsupported_tensor_parallel(vllm_config: VllmConfig) -> None:
    """What tensor parallelism (models/tensor_parallel.py) does not carry yet; a model whose
    heads or MLP columns the size does not divide is refused when the workers load it."""
    size = vllm_config.parallel_config.tensor_parallel_size
    what = f"--tensor-parallel-size {size}"
    # n-gram drafts come from the tokens alone, the same on every rank; the verify step is
    # a packed step like any other (rank 0's tokens and kept drafts: tokens_of_rank_zero)
    _refuse_parallel_features(vllm_config, what, speculation=("ngram",))
    model = vllm_config.model_config
    if model is None:
        return
    text = model.hf_text_config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    # hybrid (Qwen3.5): each rank also keeps whole linear-attention key and value heads
    counts = [(heads, "attention heads"), (kv_heads, "KV heads"),
              (getattr(text, "linear_num_key_heads", None), "linear-attention key heads"),
              (getattr(text, "linear_num_value_heads", None), "linear-attention value heads")]
    for n, name in counts:
        if isinstance(n, int) and n % size:
            raise UnsupportedConfiguration(
                f"[vllm-metal] {what} does not divide the model's {n} {name}: each rank keeps "
                "whole heads; choose a size that divides every kind of head")


def _refuse_unsupported(vllm_config: VllmConfig) -> None:
    _refuse_unsupported_kv_cache(vllm_config)
    parallel = vllm_config.parallel_config
    backend = getattr(parallel, "distributed_executor_backend", None)
    if backend not in (None, "mp", "uni") and parallel.world_size > 1:
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", str(backend))
        _refuse(f"--distributed-executor-backend {name}",
                "the ranks run under vLLM's mp executor; across Macs pass --nnodes, --node-rank "
                "and --master-addr (docs/distributed.md)")
    if getattr(parallel, "enable_expert_parallel", False):
        _refuse("expert parallelism (--enable-expert-parallel)",
                "--tensor-parallel-size splits every expert's columns instead")
    if parallel.pipeline_parallel_size > 1 and parallel.tensor_parallel_size > 1:
        _refuse("tensor and pipeline parallelism together", "choose one of them")
    if parallel.data_parallel_size > 1 and parallel.world_size > 1:
        _refuse("data parallelism together with tensor or pipeline parallelism",
                "choose one of them")
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        _refuse_unusable_distributed_backend()
    if parallel.pipeline_parallel_size > 1:
        _refuse_unsupported_pipeline_parallel(vllm_config)
    if parallel.tensor_parallel_size > 1:
        _refuse_unsupported_tensor_parallel(vllm_config)
    from vllm_metal.data_parallel import refusal as data_parallel_refusal

    if refused := data_parallel_refusal(vllm_config):
        _refuse(*refused)
    if vllm_config.lora_config is not None:
        _refuse_unsupported_lora(vllm_config)
    model = vllm_config.model_config
    if model is None:
        return
    if vllm_config.speculative_config is not None:
        from vllm_metal.speculative import unsupported_reason

        reason = unsupported_reason(vllm_config)
        if reason:
            raise UnsupportedConfiguration(f"[vllm-metal] {reason}")
    if getattr(model, "enable_prompt_embeds", False):
        # the runner feeds token ids only: embeddings would be replaced by placeholder ids
        _refuse("--enable-prompt-embeds (prompt embeddings as input)",
                "send prompts as text or token ids")
    _refuse_unsupported_outputs(vllm_config)
    _refuse_unapplied_hf_overrides(model)
    archs = set(getattr(model.hf_config, "architectures", None) or [])
    if model.runner_type == "pooling":
        _refuse_unsupported_pooling(vllm_config, archs)
    elif model.runner_type != "generate":
        _refuse(f"the '{model.runner_type}' runner", "use --runner generate or --runner pooling")
    elif archs & ENCODER_ARCHITECTURES:
        _refuse(f"generation with the encoder {sorted(archs)}",
                "an encoder serves embeddings and scores: use --runner pooling")
    elif not archs & SUPPORTED_ARCHITECTURES:
        _refuse(f"architecture {sorted(archs) or 'unknown'}",
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        _refuse(f"--kv-cache-dtype {vllm_config.cache_config.cache_dtype}", "use auto")
    for flag in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
        value = getattr(vllm_config.cache_config, flag, "auto")
        if value not in ("auto", None) and archs & HYBRID_ARCHITECTURES:
            _refuse(f"--{flag.replace('_', '-')} {value}",
                    "the linear-attention state is kept in the model's dtype, its SSM part in float32")
    if model.quantization not in (None, "gguf"):
        _refuse(f"quantization '{model.quantization}'", "serve safetensors in float16/bfloat16 or a GGUF file")
    if "moe_expert_offload" in (getattr(vllm_config, "additional_config", None) or {}):
        _refuse_unsupported_offload(vllm_config, archs)


# --hf-overrides keys that take effect here: vLLM reads them from its own config (the
# architecture, max_model_len from max_position_embeddings) or the runner does (the
# Qwen3-Reranker-style classifier: models/token_classifier.py). The model itself is built
# from config.json on disk, so any other key (rope_scaling, sliding_window, ...) would be
# accepted and not applied.
HF_OVERRIDES_APPLIED = {"architectures", "max_position_embeddings", "classifier_from_token",
                        "method", "is_original_qwen3_reranker"}


def _refuse_unapplied_hf_overrides(model) -> None:
    overrides = getattr(model, "hf_overrides", None) or {}
    if callable(overrides):
        _refuse("--hf-overrides as a function", "pass a JSON object of "
                f"{', '.join(sorted(HF_OVERRIDES_APPLIED))}")
    unapplied = sorted(set(overrides) - HF_OVERRIDES_APPLIED)
    if unapplied:
        _refuse(f"--hf-overrides {', '.join(unapplied)} (the model is built from its config.json)",
                f"the keys applied are {', '.join(sorted(HF_OVERRIDES_APPLIED))}; edit the "
                "checkpoint's config.json for the others")


def _refuse_unsupported_outputs(vllm_config: VllmConfig) -> None:
    """vLLM options that change what a request's output is, which the runner and its sampler
    do not do: served anyway, each would answer as if it were off (text that is not
    watermarked, tokens sampled instead of replayed, responses without routing data)."""
    if getattr(vllm_config, "watermark_config", None) is not None:
        _refuse("--watermark-config (watermarked sampling)", "the sampler does not watermark")
    if getattr(vllm_config.model_config, "enable_trace_replay", False):
        _refuse("--enable-trace-replay (trace_decode_token_ids)", "the sampler does not replay traces")
    if getattr(getattr(vllm_config, "aux_output_config", None), "enable_return_routed_experts", False):
        _refuse("--enable-return-routed-experts", "the MoE layers do not record their routing")
    if getattr(vllm_config, "diffusion_config", None) is not None:
        _refuse("--diffusion-config (diffusion decoding)")
    if getattr(vllm_config.model_config, "return_sampling_mask", False):
        _refuse("--return-sampling-mask", "the sampler does not report its masks")


def _refuse_unsupported_offload(vllm_config: VllmConfig, archs: set[str]) -> None:
    """moe_expert_offload: a well-formed option, a MoE model we stream, a cache that can hold
    one layer's top-k (in experts; a size in GiB is checked against the file at load)."""
    from vllm_metal.models.expert_offload import OffloadConfig

    try:
        cfg = OffloadConfig.parse(vllm_config.additional_config["moe_expert_offload"])
    except ValueError as e:
        raise UnsupportedConfiguration(str(e)) from None
    model = vllm_config.model_config
    if model.runner_type != "generate":
        _refuse("moe_expert_offload with --runner pooling")
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        _refuse("moe_expert_offload with --tensor-parallel-size",
                "streamed experts stay whole on one rank; use --pipeline-parallel-size")
    hf = model.hf_text_config
    num_experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    if not archs & STREAMED_MOE_ARCHITECTURES:
        what = "a model without mixture-of-experts layers" if not num_experts else "this MoE model"
        _refuse(f"moe_expert_offload with {what} ({sorted(archs)})",
                f"experts stream for {', '.join(sorted(STREAMED_MOE_ARCHITECTURES))}")
    top_k = int(getattr(hf, "num_experts_per_tok", 1))
    moe_layers = sum(1 for i in range(hf.num_hidden_layers)
                     if i not in (getattr(hf, "mlp_only_layers", None) or []))
    total = moe_layers * int(num_experts)
    held = None
    if cfg.cache_experts is not None:
        held = int(cfg.cache_experts)
    elif cfg.cache_fraction is not None:
        held = int(-(-cfg.cache_fraction * total // 1))
    if held is not None and held < top_k:
        _refuse(f"moe_expert_offload with a cache of {held} experts",
                f"one layer's top-k needs {top_k} (the model has {total} experts)")


def _refuse_unsupported_encoder(vllm_config: VllmConfig) -> None:
    model = vllm_config.model_config
    if vllm_config.scheduler_config.enable_chunked_prefill:
        # vLLM turns it off by default for encoders; an explicit --enable-chunked-prefill
        _refuse("chunked prefill with an encoder (it attends both ways: a prompt runs in one step)",
                "drop --enable-chunked-prefill")
    hf = model.hf_config
    if set(getattr(hf, "architectures", None) or []) & GEMMA3_ENCODER_ARCHITECTURES:
        from vllm_metal.models.gemma3_encoder import max_tokens

        if not getattr(hf, "use_bidirectional_attention", False):
            _refuse("Gemma3TextModel without use_bidirectional_attention",
                    "EmbeddingGemma checkpoints set it; a causal Gemma 3 serves as Gemma3ForCausalLM")
        longest = max_tokens(hf)  # its positions (models/gemma3_encoder.py)
        if model.max_model_len > longest:
            _refuse(f"--max-model-len {model.max_model_len} for EmbeddingGemma, whose positions "
                    f"reach {longest}", f"pass --max-model-len {longest}")
        return
    # RoBERTa / XLM-R number positions from padding_idx + 1 (models/bert.py)
    roberta = getattr(hf, "model_type", "") in ("roberta", "xlm-roberta")
    offset = getattr(hf, "pad_token_id", 1) + 1 if roberta else 0
    longest = getattr(hf, "max_position_embeddings", 512) - offset
    if model.max_model_len > longest:
        _refuse(f"--max-model-len {model.max_model_len} for an encoder whose position table holds "
                f"{longest} tokens", f"pass --max-model-len {longest}")


def _refuse_unsupported_pooling(vllm_config: VllmConfig, archs: set[str]) -> None:
    """What the pooling runner (pooling.py) does not do."""
    model = vllm_config.model_config
    decoders = SUPPORTED_ARCHITECTURES - HYBRID_ARCHITECTURES
    served = decoders | SEQUENCE_CLASSIFIERS | ENCODER_ARCHITECTURES
    if not archs & served:
        _refuse(f"architecture {sorted(archs) or 'unknown'} with --runner pooling",
                f"supported: {', '.join(sorted(served))}")
    if archs & ENCODER_ARCHITECTURES:
        _refuse_unsupported_encoder(vllm_config)
    if getattr(model.hf_config, "gguf_pooling_type", None) == "RANK":  # models/gguf_dir.py
        _refuse("a GGUF reranker (pooling_type RANK) of an architecture other than llama.cpp's 'bert'",
                "BERT rerankers (cls + cls.output head) are served; for others serve the safetensors "
                "reranker, or a GGUF embedding file (MEAN, CLS or LAST)")
    if vllm_config.scheduler_config.async_scheduling:
        _refuse("--async-scheduling with --runner pooling", "pooling steps are synchronous")
    if vllm_config.speculative_config is not None:
        _refuse("speculative decoding with --runner pooling")
    pooler = model.pooler_config
    if pooler.tok_pooling_type not in (None, "ALL"):
        _refuse(f"token pooling type {pooler.tok_pooling_type}", "supported: ALL")
    if pooler.seq_pooling_type not in (None, "LAST", "MEAN", "CLS"):
        _refuse(f"pooling type {pooler.seq_pooling_type}", "supported: LAST, MEAN, CLS, ALL")
    if pooler.seq_pooling_type in ("MEAN", "CLS") and vllm_config.cache_config.enable_prefix_caching:
        # a prefix-cache hit skips the hidden states of the cached tokens
        _refuse(f"prefix caching with {pooler.seq_pooling_type} pooling", "drop --enable-prefix-caching")
