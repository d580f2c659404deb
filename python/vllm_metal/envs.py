"""Every environment variable vllm-metal reads, in one place.

Each entry: name -> (parser, default, description). Read lazily through
``vllm_metal.envs.VLLM_METAL_<NAME>`` so tests can monkeypatch os.environ.
Documented in docs/environment.md (a test keeps the two in sync).
"""

from __future__ import annotations

import os
from typing import Any, Callable


def _bool(value: str) -> bool:
    # one boolean parser for every flag
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {value!r}")


def _kernels(value: str) -> str:
    v = value.strip().lower()
    if v not in ("native", "emulated"):
        raise ValueError(f"expected 'native' or 'emulated', got {value!r}")
    return v


def _distributed_backend(value: str) -> str:
    v = value.strip().lower()
    if v not in ("ring", "jaccl"):
        raise ValueError(f"expected 'ring' or 'jaccl', got {value!r}")
    return v


def _int(value: str) -> int:
    return int(value)


def _count(value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(f"must be >= 0, got {n}")
    return n


ENVIRONMENT: dict[str, tuple[Callable[[str], Any], Any, str]] = {
    "VLLM_METAL_KERNELS": (
        _kernels,
        "native",
        "'native': C++ CPU kernels on Linux, Metal on Apple GPUs. 'emulated': run every "
        "op's Metal kernels in the MSL emulator on the CPU (slow; needs clang-19).",
    ),
    "VLLM_METAL_NUM_THREADS": (
        _int,
        0,
        "Threads used by the C++ CPU kernels; 0 means all cores.",
    ),
    "VLLM_METAL_INT8_ACTIVATIONS": (
        _bool,
        False,
        "CPU only: multiply GGUF weights with activations rounded to 8-bit blocks (llama.cpp's "
        "scheme: about 2x faster decode, results differ from float32 by that rounding). Off: "
        "float32 sums, as the Metal kernels compute.",
    ),
    "VLLM_METAL_FUSED_LAYERS": (
        _bool,
        True,
        "Run each llama-family decoder layer as one fused op (ops.decoder_layer): on the CPU "
        "instead of ~20 MLX ops, on the GPU (and emulated) its Metal plan (fused kernels for "
        "steps of up to 8 tokens); 0 runs the per-op path (same arithmetic but act(gate) * up).",
    ),
    "VLLM_METAL_NATIVE_SAMPLING": (
        _bool,
        True,
        "Sample with the native MLX sampler; 0 runs vLLM's own torch Sampler on the same "
        "logits instead (for comparison).",
    ),
    "VLLM_BATCH_INVARIANT": (
        _bool,
        False,
        "vLLM's batch-invariant mode: every kernel gives a request's rows results that do not "
        "depend on the rest of the batch (fixed reduction order and split sizes per row), so "
        "greedy and seeded outputs and logprobs are bit-identical alone or batched "
        "(docs/serving.md).",
    ),
    "VLLM_METAL_HYBRID_STATE_CHECKPOINTS": (
        _count,
        16,
        "Hybrid models (Qwen3.5) with prefix caching: how many linear-attention states after "
        "cached prefixes are kept (least recently used evicted); each costs one request's "
        "state from the KV budget. 0 turns prefix caching off for them (docs/hybrid.md).",
    ),
    "VLLM_METAL_TEST_FAIL_FORWARD_AT_STEP": (
        _int,
        0,
        "Tests only (fault injection): the worker raises inside the forward of its N-th "
        "non-empty step (1-based); 0 never. docs/reliability.md says what the server does then.",
    ),
    "VLLM_METAL_RING_ADDRESS": (
        str,
        "",
        "Tensor/pipeline parallel: the host:port this host's MLX ring (mx.distributed) "
        "listens on, as the other hosts reach it (a host's workers take port + local rank); "
        "empty: a free port on 127.0.0.1 on one host, on vLLM's host IP across hosts "
        "(docs/distributed.md).",
    ),
    "VLLM_METAL_DISTRIBUTED_BACKEND": (
        _distributed_backend,
        "ring",
        "Tensor/pipeline parallel: MLX's backend for the tensors. 'ring': TCP, any network "
        "(loopback on one host). 'jaccl': RDMA over Thunderbolt 5 (MLX's JACCL; macOS 26.2+, "
        "MLX_IBV_DEVICES names the devices; docs/distributed.md).",
    ),
    "VLLM_METAL_DISABLE": (
        _bool,
        False,
        "Turn the vLLM platform plugin off (vLLM then picks another platform).",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in ENVIRONMENT:
        raise AttributeError(name)
    parse, default, _ = ENVIRONMENT[name]
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def __dir__() -> list[str]:
    return sorted(ENVIRONMENT)
