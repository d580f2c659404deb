"""MoE experts streamed from disk through a bounded cache (models/expert_offload.py,
expert_cache.py): with a cache holding 25% of the experts, greedy tokens equal the
fully resident model's (itself checked against transformers in test_models_qwen3_moe*),
from safetensors and from GGUF blocks, with and without prefetch, LRU and FIFO; peak
memory (a subprocess's RSS and MLX's peak) stays under the non-expert weights + the
cache + a stated margin while the resident model exceeds it; bad options, non-MoE
models, unknown expert layouts and too-small caches are refused with messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from test_models_qwen3_moe import write_checkpoint  # noqa: E402
from test_models_qwen3_moe_gguf import write_gguf  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.expert_offload import OffloadConfig  # noqa: E402
from vllm_metal.models.generate import greedy_generate  # noqa: E402
from vllm_metal.models.synthetic_moe import write_qwen3_moe  # noqa: E402

VOCAB = 320


def _prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(3, VOCAB, n).tolist() for n in (5, 11, 2)]


def _generate(loaded, n=12):
    return greedy_generate(loaded, _prompts(), n, block_size=4, prefill_chunk=4, stop_ids=[])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_stream")
    config, _ = write_checkpoint(path, seed=0, vocab_size=VOCAB, num_experts=8)
    return path, config


@pytest.mark.parametrize("option", [
    {"cache_fraction": 0.25, "prefetch": True},
    {"cache_fraction": 0.25, "policy": "fifo"},
    {"cache_experts": 6},
], ids=["lru-prefetch", "fifo-no-prefetch", "6-experts"])
def test_streamed_safetensors_tokens_match_resident(tiny, option):
    path, config = tiny
    want = _generate(load_model(str(path), "float32"))
    loaded = load_model(str(path), "float32", expert_offload=OffloadConfig.parse(option))
    got = _generate(loaded)
    assert got == want
    cache = loaded.expert_cache
    total = config.num_hidden_layers * config.num_experts
    assert sum(p.slots for p in cache.pools) == option.get("cache_experts", total // 4)
    s = cache.stats
    assert s.misses > total  # a 25% cache re-reads experts
    # every miss reads one expert's three projections: float32 [I, H] x 2 + [H, I]
    assert s.bytes_streamed == s.misses * 3 * config.moe_intermediate_size * config.hidden_size * 4
    assert (s.prefetched > 0) == option.get("prefetch", False)


def test_streamed_gguf_blocks_tokens_match_resident(tiny, tmp_path):
    path, config = tiny
    gguf_path = write_gguf(path, config, tmp_path / "tiny.gguf", "Q8_0")
    want = _generate(load_model(str(gguf_path)))
    loaded = load_model(str(gguf_path), expert_offload=OffloadConfig.parse({"cache_fraction": 0.25}))
    assert _generate(loaded) == want
    s = loaded.expert_cache.stats
    assert s.misses > 0 and s.hits + s.misses > s.misses
    # Q8_0: 34 bytes per 32 weights, three [I, H]-sized projections per expert
    per_expert = 3 * config.moe_intermediate_size * config.hidden_size // 32 * 34
    assert s.bytes_streamed == s.misses * per_expert


def test_streamed_on_emulated_metal_kernels_matches_resident(tmp_path):
    """The streamed layers' fused_moe / fused_moe_gguf (and the rest of the model) on their
    Metal kernels in the emulator, against the resident model on the CPU kernels; head_dim
    64, a size the Metal attention kernels take."""
    from vllm_metal import ops

    config, _ = write_checkpoint(tmp_path, seed=0, vocab_size=VOCAB, num_experts=8, head_dim=64)
    gguf_path = write_gguf(tmp_path, config, tmp_path / "tiny.gguf", "Q8_0")
    option = OffloadConfig.parse({"cache_fraction": 0.25})
    for source, dtype in ((tmp_path, "float32"), (gguf_path, None)):
        want = _generate(load_model(str(source), dtype), 6)
        previous = ops.kernel_backend()
        ops.set_kernel_backend("emulated")
        try:
            loaded = load_model(str(source), dtype, expert_offload=option)
            assert _generate(loaded, 6) == want, source
        finally:
            ops.set_kernel_backend(previous)
        assert loaded.expert_cache.stats.misses > 0


def test_streamed_qwen3_5_moe_tokens_match_resident(tmp_path):
    """Qwen3.5-MoE (hybrid layers, shared expert beside the routed ones): the published
    fused layout (experts.gate_up_proj) from safetensors, and a Q8_0 qwen35moe GGUF."""
    from qwen3_5_checkpoint import MOE_CONFIG, random_model, run_packed_greedy, write_checkpoint
    from qwen3_5_checkpoint import write_gguf as write_qwen35_gguf

    path = write_checkpoint(tmp_path / "st", seed=0, config=MOE_CONFIG)
    gguf_path = write_qwen35_gguf(random_model(seed=0, config=MOE_CONFIG), tmp_path / "q8.gguf",
                                  config=MOE_CONFIG, qtype="Q8_0")
    ps = [[5, 9, 33, 7, 100], [3, 4, 200, 17, 18, 19, 40]]
    option = OffloadConfig.parse({"cache_fraction": 0.25})
    for source, dtype in ((path, "float32"), (gguf_path, None)):
        want, _ = run_packed_greedy(load_model(str(source), dtype), ps, 8)
        loaded = load_model(str(source), dtype, expert_offload=option)
        got, _ = run_packed_greedy(loaded, ps, 8)
        assert got == want, source
        assert sum(p.slots for p in loaded.expert_cache.pools) == 4 * 8 // 4
        assert loaded.expert_cache.stats.misses > 0


def _write_mixed_gguf(checkpoint_dir, config, path, layer_types):
    """The tiny checkpoint as a qwen3moe GGUF whose layers' experts have different types
    (as a Q4_K_M file's ffn_down_exps: Q6_K in some layers, Q4_K in others)."""
    import gguf
    from safetensors.numpy import load_file

    from test_models_qwen3_moe_gguf import _EXPERTS

    plain = path.with_suffix(".plain.gguf")
    write_gguf(checkpoint_dir, config, plain, "F32")
    reader = gguf.GGUFReader(str(plain))
    st = load_file(str(checkpoint_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else None
        kind = t.name.split(".")[2] if layer is not None else None
        if kind in _EXPERTS.values():
            hf = {v: k for k, v in _EXPERTS.items()}[kind]
            stacked = np.stack([st[f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"]
                                for e in range(config.num_experts)])
            qt = gguf.GGMLQuantizationType[layer_types[layer]]
            w.add_tensor(t.name, gguf.quants.quantize(stacked, qt), raw_dtype=qt)
        else:
            w.add_tensor(t.name, np.array(t.data).reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_layers_with_different_expert_types_get_their_own_pools(tiny, tmp_path):
    path, config = tiny
    gguf_path = _write_mixed_gguf(path, config, tmp_path / "mixed.gguf", ["Q8_0", "Q4_0"])
    want = _generate(load_model(str(gguf_path)))
    loaded = load_model(str(gguf_path), expert_offload=OffloadConfig.parse({"cache_fraction": 0.25}))
    assert _generate(loaded) == want
    assert [p.slots for p in loaded.expert_cache.pools] == [2, 2]  # 25% of each layer's 8


_MEASURE = """
import json, sys
import psutil
import mlx.core as mx
import mlx_lm.utils, vllm_metal.ops, vllm_metal.models.loader, vllm_metal.models.generate  # noqa
from vllm_metal.models import load_model
from vllm_metal.models.expert_offload import OffloadConfig
from vllm_metal.models.generate import greedy_generate
option = json.loads(sys.argv[2])
rss0 = psutil.Process().memory_info().rss  # after every import
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS (VmHWM) restarts here: imports' transients do not count
mx.reset_peak_memory()
lo = load_model(sys.argv[1], "float32", expert_offload=OffloadConfig.parse(option) if option else None)
out = greedy_generate(lo, [[5, 6, 7, 8, 9], [10, 11, 12]], 8, block_size=16, prefill_chunk=16,
                      stop_ids=[])
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps(dict(rss=hwm * 1024 - rss0,
                      mlx=mx.get_peak_memory(), tokens=out,
                      cache=lo.expert_cache.nbytes() if lo.expert_cache else 0)))
"""


def _measure(path, option) -> dict:
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(path), json.dumps(option)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_peak_memory_bounded_by_cache_plus_other_weights(tmp_path):
    # experts are 96 MiB of the 100 MiB of weights (16 experts x 4 layers, float32)
    sizes = write_qwen3_moe(tmp_path / "m", hidden=256, inter=512, experts=16, layers=4)
    resident = _measure(tmp_path / "m", {})
    streamed = _measure(tmp_path / "m", {"cache_fraction": 0.25})
    assert streamed["tokens"] == resident["tokens"]
    assert streamed["cache"] == sizes["expert_bytes"] // 4
    base = sizes["other_bytes"] + streamed["cache"]
    # margins: MLX's -- the KV cache, activations, one expert being installed (6 MiB);
    # the process's -- also the allocator's free lists, read buffers, the prefetch thread (40 MiB)
    mlx_bound, rss_bound = base + 6 * 2**20, base + 40 * 2**20
    assert streamed["mlx"] <= mlx_bound < resident["mlx"]
    assert streamed["rss"] <= rss_bound < resident["rss"]


# ---- refusals ---------------------------------------------------------------------------
@pytest.mark.parametrize("value, words", [
    ({}, "exactly one of"),
    ({"cache_gb": 1, "cache_fraction": 0.5}, "exactly one of"),
    ({"cache_gb": -1}, "positive"),
    ({"cache_fraction": 1.5}, r"\(0, 1\]"),
    ({"cache_experts": 2.5}, "integer"),
    ({"cache_gb": 1, "policy": "lfu"}, "policy"),
    ({"cache_gb": 1, "bogus": 1}, "unknown keys"),
    ("4", "must be an object"),
])
def test_bad_options_refused(value, words):
    with pytest.raises(ValueError, match=words):
        OffloadConfig.parse(value)


def test_cache_smaller_than_top_k_refused(tiny):
    path, config = tiny  # top-2
    with pytest.raises(ValueError, match="fewer than one layer's top-k"):
        load_model(str(path), "float32", expert_offload=OffloadConfig.parse({"cache_experts": 1}))
    with pytest.raises(ValueError, match="fewer than one layer's top-k"):
        load_model(str(path), "float32", expert_offload=OffloadConfig.parse({"cache_gb": 1e-5}))


def test_cache_gb_sizes_the_pool_in_bytes(tiny):
    path, config = tiny
    per_expert = 3 * config.moe_intermediate_size * config.hidden_size * 4  # float32
    gb = (5 * per_expert + per_expert // 2) / 2**30  # room for 5.5 experts: 5 slots
    loaded = load_model(str(path), "float32", expert_offload=OffloadConfig.parse({"cache_gb": gb}))
    assert [p.slots for p in loaded.expert_cache.pools] == [5]
    assert loaded.expert_cache.nbytes() == 5 * per_expert


def test_mlx_quantized_experts_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    write_qwen3_moe(tmp_path, hidden=64, inter=32, experts=4, layers=1, head_dim=16)
    t = load_file(str(tmp_path / "model.safetensors"))
    t["model.layers.0.mlp.experts.0.gate_proj.scales"] = np.ones((32, 1), np.float32)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.scales: MLX-quantized experts"):
        load_model(str(tmp_path), "float32", expert_offload=OffloadConfig.parse({"cache_gb": 1}))


def test_non_moe_model_refused(tmp_path):
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    write_random_checkpoint(tiny_config("qwen3"), tmp_path)
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        load_model(str(tmp_path), "float32", expert_offload=OffloadConfig.parse({"cache_gb": 1}))


def test_unknown_expert_layout_refused_naming_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    write_qwen3_moe(tmp_path, hidden=64, inter=32, experts=4, layers=1, head_dim=16)
    t = load_file(str(tmp_path / "model.safetensors"))
    t["model.layers.0.mlp.experts.0.w1.weight"] = t.pop("model.layers.0.mlp.experts.0.gate_proj.weight")
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"expert layout unknown.*experts\.0\.gate_proj"):
        load_model(str(tmp_path), "float32", expert_offload=OffloadConfig.parse({"cache_gb": 1}))


def _vllm_config(archs, *, runner="generate", option=None, top_k=2, experts=8, layers=2, tp=1):
    hf = SimpleNamespace(num_experts=experts, num_experts_per_tok=top_k, num_hidden_layers=layers,
                         mlp_only_layers=[])
    model = SimpleNamespace(runner_type=runner, hf_text_config=hf)
    return SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           additional_config={"moe_expert_offload": option or {"cache_gb": 1}})


@pytest.mark.parametrize("kw, words", [
    (dict(archs={"Qwen3ForCausalLM"}), "without mixture-of-experts"),
    (dict(archs={"GraniteMoeForCausalLM"}), "this MoE model"),
    (dict(archs={"Qwen3MoeForCausalLM"}, runner="pooling"), "pooling"),
    (dict(archs={"Qwen3MoeForCausalLM"}, option={"cache_experts": 1}), "top-k needs 2"),
    (dict(archs={"Qwen3MoeForCausalLM"}, option={"cache_fraction": 0.01}), "top-k needs 2"),
    (dict(archs={"Qwen3MoeForCausalLM"}, option={"cache_mb": 1}), "unknown keys"),
    (dict(archs={"Qwen3MoeForCausalLM"}, tp=2), "--tensor-parallel-size.*use --pipeline-parallel-size"),
])
def test_startup_refusals(kw, words):
    from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported_offload

    archs = kw.pop("archs")
    if "Moe" not in next(iter(archs)) and "moe" not in next(iter(archs)):
        kw.setdefault("experts", None)
    cfg = _vllm_config(archs, **kw)
    with pytest.raises(UnsupportedConfiguration, match=words):
        _refuse_unsupported_offload(cfg, archs)


def test_startup_accepts_a_streamed_moe():
    from vllm_metal.platform import _refuse_unsupported_offload

    _refuse_unsupported_offload(_vllm_config({"Qwen3MoeForCausalLM"}), {"Qwen3MoeForCausalLM"})
    _refuse_unsupported_offload(_vllm_config({"Qwen3MoeForCausalLM"}, option={"cache_experts": 2}),
                                {"Qwen3MoeForCausalLM"})
    _refuse_unsupported_offload(_vllm_config({"OlmoeForCausalLM"}), {"OlmoeForCausalLM"})


def test_startup_gpt_oss_counts_num_local_experts():
    """gpt-oss's config names its expert count num_local_experts: the top-k check sees it."""
    from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported_offload

    def cfg(option):
        c = _vllm_config({"GptOssForCausalLM"}, option=option, experts=None)
        c.model_config.hf_text_config.num_local_experts = 8
        return c

    _refuse_unsupported_offload(cfg({"cache_fraction": 0.25}), {"GptOssForCausalLM"})
    with pytest.raises(UnsupportedConfiguration, match="top-k needs 2"):
        _refuse_unsupported_offload(cfg({"cache_fraction": 0.05}), {"GptOssForCausalLM"})
