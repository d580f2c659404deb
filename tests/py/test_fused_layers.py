"""The fused CPU decoder layer (ops.decoder_layer via models/fused_layers.py).

Its numbers are proven against mlx-lm by the parity tests (test_models_parity,
test_models_gguf run with fused layers on by default); here: which models take
it, that it agrees with the per-op path it replaces (same kernels), and that bad
input is refused with a message."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from vllm_metal import _core
from vllm_metal.models import load_model
from vllm_metal.models.fused_layers import why_not_fused
from vllm_metal.models.testing import SCHEDULES, run_packed, tiny_config, write_random_checkpoint

FUSED = ["llama", "llama3", "mistral", "ministral", "qwen2", "qwen3", "gemma3"]
PER_OP = {"ministral3": "scales queries by position"}


def _load(tmp_path, name, dtype="float32", seed=1):
    return load_model(str(write_random_checkpoint(tiny_config(name), tmp_path / name, seed=seed)),
                      dtype)


@pytest.mark.parametrize("name", FUSED)
def test_llama_family_runs_fused(tmp_path, name):
    model = _load(tmp_path, name).model
    assert why_not_fused(model) is None
    assert len(model._fused_layers()) == len(model.layers)


@pytest.mark.parametrize("name", sorted(PER_OP))
def test_other_layouts_keep_the_per_op_path(tmp_path, name):
    model = _load(tmp_path, name).model
    assert PER_OP[name] in why_not_fused(model)
    assert model._fused_layers() == []


def test_float16_gemma_keeps_the_per_op_path(tmp_path):
    """float16 gemma clips its residual adds; the fused layer does not."""
    model = _load(tmp_path, "gemma3", "float16").model
    assert "clip" in why_not_fused(model)


def test_switch_keeps_the_per_op_path(tmp_path, monkeypatch):
    model = _load(tmp_path, "llama").model
    monkeypatch.setenv("VLLM_METAL_FUSED_LAYERS", "0")
    assert why_not_fused(model) == "VLLM_METAL_FUSED_LAYERS=0"


def test_emulated_backend_fuses_what_its_kernels_take(tmp_path):
    """On the Metal kernels (emulated here) the layer runs the op's Metal plan, unless paged
    attention has no kernel for the head size; up to 8 tokens a step on the fused kernels."""
    from vllm_metal import ops
    from vllm_metal.models.fused_layers import METAL_MAX_TOKENS, runs_fused_kernels

    small = _load(tmp_path / "d16", "llama").model  # head size 16
    wide = load_model(str(write_random_checkpoint(tiny_config("llama", head_dim=64),
                                                  tmp_path / "d64", seed=1)), "float32").model
    assert not runs_fused_kernels(1)  # the native CPU backend runs its CPU kernels
    previous = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    try:
        assert "no Metal attention kernel for head size 16" in why_not_fused(small)
        assert why_not_fused(wide) is None
        assert runs_fused_kernels(METAL_MAX_TOKENS) and not runs_fused_kernels(METAL_MAX_TOKENS + 1)
        ops.set_batch_invariant(True)
        assert runs_fused_kernels(METAL_MAX_TOKENS + 1)  # mat-vec sums for every batch
    finally:
        ops.set_batch_invariant(False)
        ops.set_kernel_backend(previous)


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-6), ("float16", 2e-2), ("bfloat16", 6e-2)])
@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "ministral", "gemma3"])
def test_fused_equals_per_op(tmp_path, monkeypatch, name, dtype, tol):
    """Packed prefill chunks and decode rows over scattered cache blocks. The same kernels
    run in both; only act(gate) * up is rounded once instead of after each MLX op, so the
    reduced-precision dtypes differ by a few of their ulps (relative to the logit scale)."""
    rng = np.random.default_rng(3)
    sequences = [rng.integers(3, 300, sum(s)).tolist() for s in SCHEDULES]
    got = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("VLLM_METAL_FUSED_LAYERS", fused)
        loaded = _load(tmp_path / fused, name, dtype)
        takes_fused = fused == "1" and not (name == "gemma3" and dtype == "float16")
        assert (why_not_fused(loaded.model) is None) == takes_fused
        got[fused] = run_packed(loaded, sequences, SCHEDULES)
    for a, b in zip(got["1"], got["0"]):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(np.abs(b).max(), 1.0))


def test_chunks_without_logits_still_fill_the_cache(tmp_path, monkeypatch):
    """The fused layers write the caches in place: a prefill chunk whose logits nobody
    wants must still run (the caches it hands on depend on it), or the next chunk
    attends to an empty cache. Greedy tokens with 3-token prefill chunks equal per-op."""
    from vllm_metal.models.generate import greedy_generate

    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 300, n).tolist() for n in (11, 7)]
    out = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("VLLM_METAL_FUSED_LAYERS", fused)
        loaded = _load(tmp_path / fused, "qwen3")
        out[fused] = greedy_generate(loaded, prompts, 6, prefill_chunk=3, stop_ids=[])
    assert out["1"] == out["0"]


def _offline(model):
    from vllm_metal.models import offline

    return str(offline.smollm2_gguf() if model == "smollm2" else offline.gemma3_gguf())


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_offline_model_logits_match_per_op(monkeypatch, model):
    """The offline GGUF models (SmolLM2: Q4_1/Q8_0; Gemma-3: Q4_K_M with sandwich norms
    and GELU), run in float32 with float32 sums, packed prefill chunks and decode rows:
    fused and per-op logits agree to float32 reordering. (In their own float16 /
    bfloat16, 18-30 layers amplify the one-rounding difference of act(gate) * up into
    occasional logit differences of several units, so that comparison says little.)"""
    tol = 1e-4
    rng = np.random.default_rng(5)
    sequences = [rng.integers(100, 30000, sum(s)).tolist() for s in SCHEDULES[:3]]
    got = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("VLLM_METAL_FUSED_LAYERS", fused)
        loaded = load_model(_offline(model), "float32", int8_activations=False)
        assert (why_not_fused(loaded.model) is None) == (fused == "1")
        got[fused] = run_packed(loaded, sequences, SCHEDULES[:3], block_size=16)
    for a, b in zip(got["1"], got["0"]):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


def test_smollm2_greedy_tokens_equal_per_op(monkeypatch):
    """The served default model picks the same greedy tokens fused and per-op, alone and
    batched (float16 rounding differs in act(gate) * up only)."""
    from vllm_metal.models.generate import greedy_generate

    prompts = [[1, 504, 3458, 282, 4649, 314, 30, 2], list(range(1, 13))]
    out = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("VLLM_METAL_FUSED_LAYERS", fused)
        out[fused] = greedy_generate(load_model(_offline("smollm2"), int8_activations=False),
                                     prompts, 16)
    assert out["1"] == out["0"]


# ---- the op's own checks ----------------------------------------------------------------


@pytest.fixture(scope="module")
def layer_call(tmp_path_factory):
    """(args, kwargs) of one valid decoder_layer call on a tiny llama layer."""
    loaded = _load(tmp_path_factory.mktemp("op"), "llama")
    layer = loaded.model._fused_layers()[0]
    spec = layer.spec
    t, blocks, block_size = 3, 4, 4
    cache = mx.zeros((blocks, block_size, spec.num_kv_heads, spec.head_dim))
    args = dict(x=mx.random.normal((t, spec.hidden)), positions=mx.arange(t, dtype=mx.int32),
                slot_mapping=mx.array([0, 1, 2], mx.int64),
                block_tables=mx.array([[0]], mx.int32), seq_lens=mx.array([t], mx.int32),
                cu_seqlens_q=mx.array([0, t], mx.int32), key_cache=cache, value_cache=cache,
                rope_table=layer.rope_table, weights=list(layer.weights), spec=spec)
    return args


def test_valid_call_writes_the_caches_in_place(layer_call):
    args = dict(layer_call, key_cache=mx.zeros_like(layer_call["key_cache"]),
                value_cache=mx.zeros_like(layer_call["value_cache"]))
    mx.eval(args["key_cache"], args["value_cache"])
    out = _core.decoder_layer(**args)
    mx.eval(out)
    assert out.shape == args["x"].shape and np.isfinite(np.array(out)).all()
    for cache in (args["key_cache"], args["value_cache"]):
        written = np.abs(np.array(cache)).sum(axis=(2, 3))  # [blocks, block_size]
        assert (written[0, :3] > 0).all() and written[0, 3:].sum() == 0 and written[1:].sum() == 0


@pytest.mark.parametrize("view", ["offset_slice", "broadcast", "transposed"])
def test_a_cache_that_is_a_view_is_refused(layer_call, view):
    """In-place writes must land in a whole buffer: an offset slice of a bigger array, a
    broadcast or a strided view is refused at eval, before anything is written."""
    shape = layer_call["key_cache"].shape
    big = mx.zeros((2 * shape[0],) + shape[1:])
    mx.eval(big)
    cache = {"offset_slice": big[shape[0]:],
             "broadcast": mx.broadcast_to(mx.zeros((1,) + shape[1:]), shape),
             "transposed": mx.zeros((shape[1], shape[0]) + shape[2:]).swapaxes(0, 1)}[view]
    mx.eval(cache)
    args = dict(layer_call, key_cache=cache)
    with pytest.raises(Exception, match="key_cache is updated in place"):
        mx.eval(_core.decoder_layer(**args))
    assert np.array(big).sum() == 0


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(weights=a["weights"][:-1]), "expected 9 weights"),
    (lambda a: a.update(x=a["x"].astype(mx.int32)), "x must be float32"),
    (lambda a: a.update(positions=a["positions"].astype(mx.int64)), "positions must be int32"),
    (lambda a: a.update(key_cache=a["key_cache"].astype(mx.float16)), "key_cache must be float32"),
    (lambda a: a.update(weights=[a["weights"][0][:-1]] + a["weights"][1:]), "input_norm must have shape"),
    (lambda a: a.update(weights=a["weights"][:2] + [a["weights"][2][:-1]] + a["weights"][3:]),
     "q_proj must hold"),
])
def test_bad_input_is_refused(layer_call, change, message):
    args = dict(layer_call)
    change(args)
    with pytest.raises(ValueError, match=message):
        _core.decoder_layer(**args)


def test_out_of_range_slot_is_refused_at_eval(layer_call):
    args = dict(layer_call, slot_mapping=mx.array([0, 1, 99], mx.int64))
    with pytest.raises(Exception, match=r"slot_mapping\[2\] = 99 is outside"):
        mx.eval(_core.decoder_layer(**args))
