"""A pipeline stage loads only its layers (models/stage_loading.py): the peak memory of
loading stage 0 of 2 of a model whose layers hold almost all its bytes, measured in a process
of its own, is about half of a whole load's; from safetensors and from GGUF files (F32 and
Q8_0), the hybrid Qwen3.5's included. (That the stages still serve the one-process tokens: test_serving_pipeline_parallel.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_metal.models.stage_loading import only_layers, outside_stage

LAYERS = 8

# Each load in turn in one process: the peak RSS (VmHWM) restarts before each, and each is
# measured above the RSS it starts from (the previous model freed, MLX's cache cleared,
# glibc's heap trimmed: Linux only, as /proc/self/clear_refs is).
_MEASURE = """
import ctypes, gc, json, sys
import psutil
import mlx.core as mx
import mlx_lm.utils, vllm_metal.ops, vllm_metal.models.loader  # noqa
from vllm_metal.models import load_model
from vllm_metal.models.stage_loading import only_layers
peaks = []
for path, kept in json.loads(sys.argv[1]):
    gc.collect()
    mx.clear_cache()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system
    rss0 = psutil.Process().memory_info().rss
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) restarts here
    if kept is None:
        lo = load_model(path, "float32")
    else:
        with only_layers(range(*kept)):
            lo = load_model(path, "float32")
    hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
    peaks.append(hwm * 1024 - rss0)
    del lo
print(json.dumps(peaks))
"""

LAYER_BYTES = 4 * (4 * 512 * 512 + 3 * 512 * 2048)  # float32


@pytest.fixture(scope="module")
def peaks(tmp_path_factory) -> dict:
    """name -> (peak bytes of a whole load, of stage 0 of 2), for every model below; stage
    first, so a whole load cannot reuse memory the stage's left behind."""
    from qwen3_5_checkpoint import CONFIG, random_model, write_gguf
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint, write_tiny_gguf

    tmp = tmp_path_factory.mktemp("stage")
    # a llama whose layers hold almost all its bytes (8 x 16.8 MB float32, a 320-token vocabulary)
    cfg = tiny_config("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=LAYERS,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=64, vocab_size=320)
    models = {"safetensors": write_random_checkpoint(cfg, tmp / "st", seed=0)}
    config = json.loads((models["safetensors"] / "config.json").read_text())
    for qtype in ("F32", "Q8_0"):
        models[qtype] = tmp / f"stage-{qtype}.gguf"
        write_tiny_gguf(config, models[qtype], qtype=qtype)
    # the hybrid Qwen3.5 GGUF loader (value heads reordered, conv and A rewritten): 3
    # linear-attention layers to 1 full
    q35 = dict(CONFIG, hidden_size=512, intermediate_size=2048, num_hidden_layers=LAYERS,
               num_attention_heads=16, num_key_value_heads=8, head_dim=32,  # CONFIG's rope
               linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
               linear_value_head_dim=64, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    models["qwen3_5"] = tmp / "stage-qwen35.gguf"
    write_gguf(random_model(seed=0, config=q35), models["qwen3_5"], q35)
    jobs = [[str(path), kept] for path in models.values() for kept in ([0, LAYERS // 2], None)]
    r = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(jobs)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    measured = json.loads(r.stdout.strip().splitlines()[-1])
    return {name: (measured[2 * i + 1], measured[2 * i]) for i, name in enumerate(models)}


def _check(peaks, name: str, layer_bytes: float) -> None:
    whole, stage = peaks[name]
    assert whole > LAYERS * layer_bytes * 0.9, whole  # a whole load reads every layer
    assert stage < 0.6 * whole, (stage, whole)  # stage 0 of 2: its 4 layers (and small tensors)


def test_a_stage_reads_only_its_layers_from_safetensors(peaks):
    _check(peaks, "safetensors", LAYER_BYTES)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_stage_reads_only_its_layers_from_gguf(peaks, qtype):
    _check(peaks, qtype, LAYER_BYTES * (1 if qtype == "F32" else 34 / 128))  # Q8_0: 34 bytes per 32


def test_a_stage_reads_only_its_layers_from_a_hybrid_qwen3_5_gguf(peaks):
    # a layer's MLP alone is 12 MB float32; attention or the gated delta net add 2-4 MB
    _check(peaks, "qwen3_5", 4 * 3 * 512 * 2048)


def test_which_names_lie_outside_a_stage():
    names = ["lm.model.layers.3.mlp.up_proj.weight", "blk.3.ffn_up.weight",
             "lm.model.layers.13.self_attn.q_proj.weight", "lm.model.embed_tokens.weight",
             "token_embd.weight", "output.weight"]
    assert not any(outside_stage(n) for n in names)  # outside only_layers: nothing
    with only_layers(range(4, 8)):
        assert [outside_stage(n) for n in names] == [True, True, True, False, False, False]
    with only_layers(range(0, 4)):
        assert [outside_stage(n) for n in names] == [False, False, True, False, False, False]
