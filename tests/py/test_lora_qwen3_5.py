"""LoRA on the hybrid Qwen3.5 (tiny random checkpoint, no server): adapters on the full
attention q/k/v/o, the MLP gate/up/down and the gated delta net's in_proj_qkv /
in_proj_z / out_proj give, in one packed batch mixing two adapters and the base, each
prompt the logits of the checkpoint with its adapter merged in NumPy (W + scale * B @ A)."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm.models.qwen3_5")

from lora_checkpoint import base_weights, write_adapter, write_gguf_adapter, write_merged  # noqa: E402
from qwen3_5_checkpoint import CONFIG, write_checkpoint  # noqa: E402
from vllm_metal.lora.manager import LoraManager  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402

LAYERS = CONFIG["num_hidden_layers"]
PROMPTS = [[5, 9, 30, 7, 2, 44, 61, 3], [3, 3, 8, 200], [100, 17, 56, 90, 12, 4, 250]]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
       "in_proj_qkv", "in_proj_z", "out_proj")


def request(lid, path=""):
    return SimpleNamespace(lora_int_id=lid, lora_name=f"a{lid}", lora_path=str(path),
                           load_inplace=False)


def prefill_logits(loaded, prompts, lora=None, loras=None):
    """All prompts in one packed prefill step, each from a zero state; every position's
    logits per prompt."""
    from vllm_metal.models.generate import KVPool, SeqChunk, build_step
    from vllm_metal.models.qwen3_5_paged import HybridContext

    pool = KVPool(loaded.spec, 32, 4)
    tables = [[] for _ in prompts]
    for t, p in zip(tables, prompts):
        pool.allocate(t, len(p))
    packed = build_step([SeqChunk(p, 0, t, "all") for p, t in zip(prompts, tables)],
                        pool.kv_caches, 4)
    c = packed.ctx
    n = len(prompts)
    ctx = HybridContext(**{f.name: getattr(c, f.name) for f in fields(c)},
                        cu_seqlens_state=c.cu_seqlens_q,
                        state_slots=mx.array(list(range(n, 0, -1)), mx.int32),
                        has_initial_state=mx.zeros(n, mx.int32),
                        state_pools=loaded.model.make_state_pools(n + 1, mx.float32))
    ids = [f"r{i}" for i in range(n)]
    if lora is not None:
        for rid, lid in zip(ids, loras):
            lora.request_added(rid, request(lid) if lid else None)
        lora.begin_step(ids, np.array(c.cu_seqlens_q))
    try:
        logits = np.array(loaded.model(packed.input_ids, ctx))
    finally:
        if lora is not None:
            lora.end_step()
            lora.requests_removed(ids)
    out, row = [], 0
    for p in prompts:
        out.append(logits[row:row + len(p)])
        row += len(p)
    return out


def _with_adapters(base, tmp_path, deltas):
    """The base loaded, and a LoraManager holding the adapters tmp_path/a<id> of `deltas`."""
    loaded = load_model(str(base), "float32")
    lora = LoraManager(loaded.model, SimpleNamespace(max_loras=2, max_lora_rank=8, max_cpu_loras=2))
    for lid in deltas:
        lora.add(request(lid, tmp_path / f"a{lid}"))
    return loaded, lora


def test_mixed_batch_on_qwen3_5_equals_merged_checkpoints(tmp_path):
    base = write_checkpoint(tmp_path / "base", seed=0)
    w = base_weights(base)
    deltas = {
        1: write_adapter(tmp_path / "a1", w, LAYERS, r=8, alpha=16, seed=31, targets=ALL,
                         magnitude=2.0),
        # the gated delta net only, one linear-attention layer
        2: write_adapter(tmp_path / "a2", w, LAYERS, r=4, alpha=8, seed=32, layers=[1],
                         targets=("in_proj_qkv", "in_proj_z", "out_proj"), magnitude=2.0),
    }
    assert any("linear_attn" in m for m in deltas[1]) and any("self_attn" in m for m in deltas[1])
    loaded, lora = _with_adapters(base, tmp_path, deltas)
    assert loaded.hybrid is not None
    loras = [1, 0, 2]
    got = prefill_logits(loaded, PROMPTS, lora, loras)
    base_logits = prefill_logits(load_model(str(base), "float32"), PROMPTS)
    for i, (lid, g) in enumerate(zip(loras, got)):
        if lid == 0:
            want = base_logits[i]
        else:
            merged = write_merged(base, tmp_path / f"m{lid}", deltas[lid])
            want = prefill_logits(load_model(str(merged), "float32"), [PROMPTS[i]])[0]
            assert np.abs(want - base_logits[i]).max() > 1e-2  # the adapter moves the logits
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4, err_msg=f"adapter {lid}")


def write_qwen35_gguf_adapter(path, deltas: dict, *, r: int, alpha: float):
    """deltas (HF order, write_adapter's) as llama.cpp's converter writes a "qwen35" LoRA:
    its tensor names, the value heads of in_proj_qkv's V rows and in_proj_z's rows (lora_b)
    and out_proj's columns (lora_a) in its tiled order."""
    import gguf

    from qwen3_5_checkpoint import _grouped_to_tiled
    from vllm_metal.models.gguf_qwen35 import _BLOCK

    hk, hv = CONFIG["linear_num_key_heads"], CONFIG["linear_num_value_heads"]
    key_dim = hk * CONFIG["linear_key_head_dim"]
    tile = lambda x, axis=0: _grouped_to_tiled(x, hk, hv, axis)  # noqa: E731
    kind = {v: k for k, v in _BLOCK.items()}
    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(alpha))
    for module, (a, b, scale) in deltas.items():
        assert scale == alpha / r
        _, _, i, rest = module.split(".", 3)
        a, b = a.astype(np.float32), b.astype(np.float32)
        if rest == "linear_attn.in_proj_qkv":
            b = np.concatenate([b[:2 * key_dim], tile(b[2 * key_dim:])])
        elif rest == "linear_attn.in_proj_z":
            b = tile(b)
        elif rest == "linear_attn.out_proj":
            a = tile(a, axis=1)
        name = f"blk.{i}.{kind[rest]}.weight"
        writer.add_tensor(name + ".lora_a", np.ascontiguousarray(a))
        writer.add_tensor(name + ".lora_b", np.ascontiguousarray(b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama_cpp_gguf_adapter_on_qwen3_5_equals_the_merged_checkpoint(tmp_path):
    """A "qwen35" GGUF LoRA (llama.cpp's names and tiled value heads: 4 value heads over 2
    key heads here) gives the logits of the checkpoint with the adapter merged in NumPy;
    an adapter of another architecture is refused naming it."""
    base = write_checkpoint(tmp_path / "base", seed=0)
    w = base_weights(base)
    deltas = write_adapter(tmp_path / "peft", w, LAYERS, r=8, alpha=16, seed=33, targets=ALL,
                           magnitude=2.0)
    assert any("in_proj_qkv" in m for m in deltas) and any("out_proj" in m for m in deltas)
    write_qwen35_gguf_adapter(tmp_path / "g.gguf", deltas, r=8, alpha=16)
    loaded = load_model(str(base), "float32")
    lora = LoraManager(loaded.model, SimpleNamespace(max_loras=1, max_lora_rank=8, max_cpu_loras=2))
    lora.add(request(1, tmp_path / "g.gguf"))
    got = prefill_logits(loaded, PROMPTS, lora, [1, 0, 1])
    base_logits = prefill_logits(load_model(str(base), "float32"), PROMPTS)
    merged = load_model(str(write_merged(base, tmp_path / "m", deltas)), "float32")
    for i, lid in enumerate([1, 0, 1]):
        want = prefill_logits(merged, [PROMPTS[i]])[0] if lid else base_logits[i]
        assert lid == 0 or np.abs(want - base_logits[i]).max() > 1e-2
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4, err_msg=f"prompt {i}")

    write_gguf_adapter(tmp_path / "q3.gguf", w, LAYERS, arch="qwen3", r=4, alpha=4, seed=1,
                       n_heads=4, n_kv_heads=2, layers=[3], targets=("v_proj",))
    with pytest.raises(ValueError, match="adapter architecture 'qwen3' does not match the "
                                         "model \\(qwen3_5\\)"):
        lora.add(request(2, tmp_path / "q3.gguf"))


@pytest.mark.slow
@pytest.mark.serving
@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_served_qwen3_5_with_adapters_matches_mlx_lm_on_the_merged_checkpoint(tmp_path, mtp):
    """`vllm serve --enable-lora` on Qwen3.5: concurrent requests with an adapter and
    without get mlx-lm's greedy tokens of the merged / base checkpoint. mtp: with MTP
    speculation (a random MTP block, which no adapter targets): the verify rows carry their
    request's adapter, so the tokens stay the merged model's whatever the head drafts."""
    import concurrent.futures

    from qwen3_5_checkpoint import greedy, reference_model
    from serving_harness import Server

    base = write_checkpoint(tmp_path / "base", seed=0, mtp=mtp)
    deltas = write_adapter(tmp_path / "a1", base_weights(base), LAYERS, r=8, alpha=16, seed=33,
                           targets=ALL, magnitude=2.0)
    merged = write_merged(base, tmp_path / "m1", deltas)
    steps = 8
    want = {"qwen3_5-tiny": [greedy(reference_model(base), p, steps) for p in PROMPTS],
            "a1": [greedy(reference_model(merged), p, steps) for p in PROMPTS]}
    assert want["a1"] != want["qwen3_5-tiny"]
    server = Server(str(base), "qwen3_5-tiny", [
        "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
        "--num-gpu-blocks-override", "32", "--enable-lora", "--max-lora-rank", "8",
        "--lora-modules", f"a1={tmp_path / 'a1'}",
        *(["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]
          if mtp else [])])
    try:
        def run(job):
            model, i = job
            r = server.client.post("/v1/completions", json={
                "model": model, "prompt": PROMPTS[i], "max_tokens": steps, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        jobs = [(m, i) for m in want for i in range(len(PROMPTS))]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(run, jobs))
        for (m, i), g in zip(jobs, got):
            assert g == want[m][i], (m, i)
        if mtp:
            drafted = re.search(r"^vllm:spec_decode_num_draft_tokens_total(?:{[^}]*})? ([0-9.e+]+)$",
                                server.client.get("/metrics").text, re.M)
            assert drafted and float(drafted.group(1)) > 0  # the head drafted; rows verified
    finally:
        server.stop()


def test_peft_adapter_on_a_qwen3_5_q8_0_gguf_base_equals_the_merged_dequantized_model(tmp_path):
    """The GGUF base keeps its projections in block form; llama.cpp's tiled value-head
    order is undone at load, so a PEFT adapter (HF order) applies as on safetensors."""
    from qwen3_5_checkpoint import random_model, write_gguf

    write_gguf(random_model(seed=0), tmp_path / "q8.gguf", qtype="Q8_0")
    ref = load_model(str(tmp_path / "q8.gguf"), "float32", linear="mlx")
    weights = {}
    for i, layer in enumerate(ref.model.layers):
        for parent in ("self_attn", "linear_attn", "mlp"):
            for name, mod in (getattr(layer, parent).children().items()
                              if hasattr(layer, parent) else ()):
                if name.endswith("_proj") or name.startswith("in_proj_"):
                    weights[f"model.layers.{i}.{parent}.{name}.weight"] = np.array(mod.weight)
    deltas = write_adapter(tmp_path / "a1", weights, LAYERS, r=8, alpha=16, seed=34, targets=ALL,
                           magnitude=2.0)
    base_logits = prefill_logits(ref, PROMPTS[:1])[0]
    for module, (a, b, scale) in deltas.items():
        _, _, i, parent, proj = module.split(".")
        lin = getattr(getattr(ref.model.layers[int(i)], parent), proj)
        lin.weight = mx.array((np.array(lin.weight).astype(np.float64)
                               + scale * (b @ a)).astype(np.float32))
    want = prefill_logits(ref, PROMPTS[:1])[0]
    assert np.abs(want - base_logits).max() > 1e-2

    loaded = load_model(str(tmp_path / "q8.gguf"), "float32", int8_activations=False)
    assert loaded.model.layers[0].linear_attn.in_proj_qkv.is_blocks
    lora = LoraManager(loaded.model, SimpleNamespace(max_loras=1, max_lora_rank=8, max_cpu_loras=1))
    lora.add(request(1, tmp_path / "a1"))
    got = prefill_logits(loaded, PROMPTS[:1], lora, [1])[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_qwen3_5_moe_experts_and_shared_expert_equal_merged_checkpoints(tmp_path):
    """Qwen3.5-MoE: adapters on the routed experts (per-expert PEFT names, the per-op
    path of lora/experts.py), on the shared expert (a dense MLP) and on the attention, two
    adapters and the base in one packed batch, against the NumPy-merged checkpoints."""
    pytest.importorskip("mlx_lm.models.qwen3_5_moe")
    from qwen3_5_checkpoint import MOE_CONFIG

    base = write_checkpoint(tmp_path / "base", seed=1, config=MOE_CONFIG, expert_layout="per_expert")
    w = base_weights(base)
    layers, num_experts = MOE_CONFIG["num_hidden_layers"], MOE_CONFIG["num_experts"]
    shared = [f"model.layers.{l}.mlp.shared_expert.{p}" for l in range(layers)
              for p in ("gate_proj", "up_proj", "down_proj")]
    routed = [f"model.layers.{l}.mlp.experts.{e}.{p}" for l in range(layers)
              for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
    attn = [m for m in (f"model.layers.{l}.{p}" for l in range(layers)
                        for p in ("self_attn.q_proj", "linear_attn.in_proj_z"))
            if m + ".weight" in w]
    deltas = {
        1: write_adapter(tmp_path / "a1", w, LAYERS, r=8, alpha=16, seed=41, magnitude=2.0,
                         modules=attn + routed),
        2: write_adapter(tmp_path / "a2", w, LAYERS, r=4, alpha=8, seed=42, magnitude=2.0,
                         modules=shared + routed[:24]),
    }
    assert all(len(d) > 0 for d in deltas.values()) and all(m + ".weight" in w for m in shared)
    loaded, lora = _with_adapters(base, tmp_path, deltas)
    loras = [2, 0, 1]
    got = prefill_logits(loaded, PROMPTS, lora, loras)
    base_logits = prefill_logits(load_model(str(base), "float32"), PROMPTS)
    for i, (lid, g) in enumerate(zip(loras, got)):
        want = base_logits[i]
        if lid:
            merged = write_merged(base, tmp_path / f"m{lid}", deltas[lid])
            want = prefill_logits(load_model(str(merged), "float32"), [PROMPTS[i]])[0]
            assert np.abs(want - base_logits[i]).max() > 1e-2
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4, err_msg=f"adapter {lid}")
