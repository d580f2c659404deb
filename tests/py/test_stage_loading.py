"""A pipeline stage loads only its layers (models/stage_loading.py): the peak memory of
loading stage 0 of 2 of a model whose layers hold almost all its bytes, measured in a fresh
process, is about half of a whole load's; from safetensors and from GGUF files (F32 and
Q8_0), the hybrid Qwen3.5's included. (That the stages still serve the one-process tokens: test_serving_pipeline_parallel.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_metal.models.stage_loading import only_layers, outside_stage

LAYERS = 8

_MEASURE = """
import json, sys
import psutil
import mlx.core as mx
import mlx_lm.utils, vllm_metal.ops, vllm_metal.models.loader  # noqa
from vllm_metal.models import load_model
from vllm_metal.models.stage_loading import only_layers
rss0 = psutil.Process().memory_info().rss  # after every import
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS (VmHWM) restarts here
kept = json.loads(sys.argv[2])
if kept is None:
    lo = load_model(sys.argv[1], "float32")
else:
    with only_layers(range(*kept)):
        lo = load_model(sys.argv[1], "float32")
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps(dict(rss=hwm * 1024 - rss0)))
"""


def _peak(path, kept) -> int:
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(path), json.dumps(kept)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["rss"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A llama whose layers hold almost all its bytes (8 x 16.8 MB float32, a 320-token
    vocabulary)."""
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    cfg = tiny_config("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=LAYERS,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=64, vocab_size=320)
    return write_random_checkpoint(cfg, tmp_path_factory.mktemp("stage"), seed=0)


LAYER_BYTES = 4 * (4 * 512 * 512 + 3 * 512 * 2048)  # float32


def _check(path, layer_bytes: float) -> None:
    whole, stage = _peak(path, None), _peak(path, [0, LAYERS // 2])
    assert whole > LAYERS * layer_bytes * 0.9, whole  # a whole load reads every layer
    assert stage < 0.6 * whole, (stage, whole)  # stage 0 of 2: its 4 layers (and small tensors)


def test_a_stage_reads_only_its_layers_from_safetensors(checkpoint):
    _check(checkpoint, LAYER_BYTES)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_stage_reads_only_its_layers_from_gguf(checkpoint, tmp_path, qtype):
    from vllm_metal.models.testing import write_tiny_gguf

    config = json.loads((checkpoint / "config.json").read_text())
    path = tmp_path / f"stage-{qtype}.gguf"
    write_tiny_gguf(config, path, qtype=qtype)
    _check(path, LAYER_BYTES * (1 if qtype == "F32" else 34 / 128))  # Q8_0: 34 bytes per 32


def test_a_stage_reads_only_its_layers_from_a_hybrid_qwen3_5_gguf(tmp_path):
    """The hybrid Qwen3.5 GGUF loader (gguf_qwen35.py: value heads reordered, conv and A
    rewritten) skips other stages' tensors too: 8 layers, 3 linear-attention to 1 full."""
    from qwen3_5_checkpoint import CONFIG, random_model, write_gguf

    config = dict(CONFIG, hidden_size=512, intermediate_size=2048, num_hidden_layers=LAYERS,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=32,  # CONFIG's rope
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                  linear_value_head_dim=64, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    path = tmp_path / "stage-qwen35.gguf"
    write_gguf(random_model(seed=0, config=config), path, config)
    # a layer's MLP alone is 12 MB float32; attention or the gated delta net add 2-4 MB
    _check(path, 4 * 3 * 512 * 2048)


def test_which_names_lie_outside_a_stage():
    names = ["lm.model.layers.3.mlp.up_proj.weight", "blk.3.ffn_up.weight",
             "lm.model.layers.13.self_attn.q_proj.weight", "lm.model.embed_tokens.weight",
             "token_embd.weight", "output.weight"]
    assert not any(outside_stage(n) for n in names)  # outside only_layers: nothing
    with only_layers(range(4, 8)):
        assert [outside_stage(n) for n in names] == [True, True, True, False, False, False]
    with only_layers(range(0, 4)):
        assert [outside_stage(n) for n in names] == [False, False, True, False, False, False]
