"""Tiny GGUF models on the Metal kernels (emulated): the fused Metal decoder layer
(decoder_layer's Metal plan, fused_layers.py) against the per-op path it replaces, and
batch invariance through it. Steps of up to 8 tokens run the fused kernels, longer ones
(prefill chunks here) the per-op kernels in the op's plan, so each schedule mixes both."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_metal import emulation, ops
from vllm_metal.models import load_model
from vllm_metal.models.fused_layers import why_not_fused
from vllm_metal.models.testing import run_packed, tiny_config, write_tiny_gguf

# decode rows next to short chunks (fused kernels) and a 13-token chunk (long-batch plan)
SCHEDULES = [[3, 1, 1, 1, 1, 1], [1, 2, 1, 1, 1], [13, 1, 1, 1], [2, 1, 3, 1, 1]]


@pytest.fixture
def emulated():
    emulation.load_all()
    previous = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    yield
    ops.set_kernel_backend(previous)


def fused_and_per_op(monkeypatch, path, dtype, sequences, schedules):
    """The packed logits of the model at `path`, fused and per op (each load checked to take
    the path asked for)."""
    got = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("VLLM_METAL_FUSED_LAYERS", fused)
        loaded = load_model(path, dtype)
        assert (why_not_fused(loaded.model) is None) == (fused == "1")
        got[fused] = run_packed(loaded, sequences, schedules)
    return got["1"], got["0"]


def _gguf(tmp_path, arch, qtype):
    path = tmp_path / f"{arch}-{qtype}.gguf"
    write_tiny_gguf(tiny_config(arch, head_dim=64, num_hidden_layers=2), path, seed=3, qtype=qtype)
    return str(path)


@pytest.mark.parametrize("arch, qtype, dtype, tol", [
    ("llama3", "Q4_K", "float32", 1e-5), ("llama3", "Q4_1", "float16", 2e-2),
    ("qwen3", "Q8_0", "bfloat16", 6e-2), ("gemma3", "Q6_K", "float32", 1e-5),
    ("gemma3", "Q4_0", "bfloat16", 6e-2)])
def test_fused_metal_layer_logits_match_per_op(emulated, tmp_path, monkeypatch, arch, qtype,
                                               dtype, tol):
    """Same kernels' arithmetic except act(gate) * up (float32, rounded once): float32 agrees
    to reordering, the half types to a few of their ulps of the logit scale."""
    path = _gguf(tmp_path, arch, qtype)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(3, 300, sum(s)).tolist() for s in SCHEDULES]
    for a, b in zip(*fused_and_per_op(monkeypatch, path, dtype, seqs, SCHEDULES)):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(np.abs(b).max(), 1.0))


@pytest.mark.parametrize("arch, qtype, dtype", [("llama3", "Q4_K", "float16"),
                                                ("gemma3", "Q6_K", "bfloat16")])
def test_fused_metal_layer_is_batch_invariant(emulated, tmp_path, arch, qtype, dtype):
    """VLLM_BATCH_INVARIANT: every step takes the fused layer (rows in groups of 8, one sum
    order per row); a sequence's logits packed with others equal its logits alone, bitwise."""
    model = load_model(_gguf(tmp_path, arch, qtype), dtype)
    assert why_not_fused(model.model) is None
    seqs = [list(range(10, 22)), list(range(40, 49)), list(range(70, 81))]
    assert_packed_equals_alone(model, seqs, [[5, 4, 1, 1, 1], [3, 1, 1, 1, 1, 1, 1], [9, 1, 1]])


def assert_packed_equals_alone(model, seqs, schedules):
    """In batch-invariant mode each sequence's logits packed (schedules) equal its logits
    alone, bitwise."""
    ops.set_batch_invariant(True)
    try:
        packed = run_packed(model, seqs, schedules)
        for i, seq in enumerate(seqs):
            alone = run_packed(model, [seq], [[len(seq)]], seed=i + 1)[0]
            differ = int((alone != packed[i]).sum())
            assert differ == 0, f"sequence {i}: {differ} of {alone.size} logits differ from alone"
    finally:
        ops.set_batch_invariant(False)
