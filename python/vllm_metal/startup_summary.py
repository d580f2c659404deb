"""What the plugin chose, in one block printed once the server is ready to warm up.

A user reading `vllm serve`'s output should see, in one place, which device runs the
model, which kernels, how the KV budget became blocks, whether layers run fused and
how GGUF weights are multiplied. Each line reads the same state the runner uses.
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal import envs, ops


def device_line() -> str:
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        name = mx.metal.device_info().get("device_name", "Apple GPU")
        return f"{name} (Metal)"
    from vllm_metal import _core

    return f"CPU (MLX's CPU backend and our C++ kernels, {_core.num_threads()} threads)"


def kernels_line() -> str:
    backend = ops.kernel_backend()
    if backend == "emulated":
        return "emulated: every op's Metal kernel runs in the MSL emulator (slow; for tests)"
    return "Metal kernels" if mx.default_device() == mx.gpu else "native C++ CPU kernels"


def fused_layers_line(model) -> str:
    from vllm_metal.models.fused_layers import why_not_fused
    from vllm_metal.models.paged_model import PagedCausalLM

    if not isinstance(model, PagedCausalLM):
        return f"no: {type(model).__name__} runs the per-op path"
    why = why_not_fused(model)
    return f"yes, {len(model.layers)} layers (ops.decoder_layer)" if why is None else f"no: {why}"


def activations_line(model) -> str:
    """How GGUF weights are multiplied (the flag every GGUFLinear carries)."""
    from vllm_metal.models.gguf_linear import GGUFLinear

    linears = [m for _, m in model.named_modules() if isinstance(m, GGUFLinear)]
    if not linears:
        return "no GGUF linear layers (MLX matmul)"
    if mx.default_device() == mx.gpu:
        return "float sums (the Metal kernels)"
    if all(m.exact for m in linears):
        return ("float32 sums, as on Metal (VLLM_METAL_INT8_ACTIVATIONS=1: 8-bit activations, "
                "faster, less exact; docs/gguf.md)")
    return "8-bit activations, llama.cpp's scheme (VLLM_METAL_INT8_ACTIVATIONS=1)"


def kv_blocks_line(vllm_config) -> str:
    """Who hands out the KV blocks: the C++ manager behind vLLM's scheduler, unless the
    user named a scheduler class of their own (scheduler.py)."""
    cls = vllm_config.scheduler_config.scheduler_cls
    cls = cls if isinstance(cls, str) or cls is None else f"{cls.__module__}.{cls.__qualname__}"
    cache = vllm_config.cache_config
    caching = (f"prefix caching on ({cache.prefix_caching_hash_algo})" if cache.enable_prefix_caching
               else "prefix caching off")
    if cls is not None and cls.startswith("vllm_metal.scheduler."):
        return f"C++ KvCacheManager behind vLLM's scheduler, {caching}"
    return f"the KV-cache manager of {cls or 'vLLM'}, {caching}"


def pooling_line(runner) -> str:
    """--runner pooling: the tasks served and how sequences are pooled (pooling.py)."""
    p = runner.pooler
    return f"{', '.join(p.supported_tasks())}; {p.seq_method} pooling (token tasks: {p.tok_method})"


def summary(runner, kv_budget: str) -> str:
    """The block, one `name: value` line each; runner is a loaded MetalModelRunner."""
    rows = [
        ("device", device_line()),
        ("kernels", kernels_line()),
        ("KV cache", f"{runner.kv_cache_description} from a budget of {kv_budget}"),
        ("KV blocks", kv_blocks_line(runner.vllm_config)),
        ("fused layers", fused_layers_line(runner.model)),
        ("GGUF activations", activations_line(runner.model)),
        ("batch invariant", "yes (VLLM_BATCH_INVARIANT=1)" if ops.batch_invariant() else "no"),
        ("scheduling", "async" if runner.async_scheduling else "sync"),
        ("sampler", "native MLX" if envs.VLLM_METAL_NATIVE_SAMPLING else "vLLM's torch Sampler")
        if runner.pooler is None else ("pooling", pooling_line(runner)),
    ]
    width = max(len(name) for name, _ in rows)
    return "vllm-metal configuration:\n" + "\n".join(f"  {n:<{width}}  {v}" for n, v in rows)
