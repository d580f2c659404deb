"""Qwen3.5's MTP block as a proposer (mtp.py), against a chain built from mlx-lm's own
modules: its full-attention DecoderLayer with a KVCache, nn.Linear and nn.RMSNorm over
the checkpoint's mtp.* tensors, fed the target's hidden states from mlx-lm's model."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from qwen3_5_checkpoint import CONFIG, reference_model, write_checkpoint

BLOCK, NUM_BLOCKS = 16, 8


class _Packer:
    """What the proposer reads of the packer: histories and held blocks."""

    def __init__(self, histories):
        self.h = histories

    def __contains__(self, r):
        return r in self.h

    def token_ids(self, r):
        return list(self.h[r])

    def block_ids(self, r):
        return [list(range(NUM_BLOCKS))]


def _reference_chain(ckpt, ref, history, hidden, k, config=CONFIG):
    """Greedy MTP drafts after history (the target sampled history[-1]) from mlx-lm's
    modules: rows 0..P-1 in one pass, then k - 1 single-token passes on its own output.
    MoE experts go from HF's fused layout to mlx-lm's stacked one (qwen3_5_loader's
    stack_experts, checked against mlx-lm in test_models_qwen3_5_moe)."""
    from mlx_lm.models import qwen3_5
    from mlx_lm.models.cache import KVCache

    from vllm_metal.models.qwen3_5_loader import stack_experts

    args = qwen3_5.TextModelArgs.from_dict(config)
    h = config["hidden_size"]
    centred = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
               "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
               "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight")
    w = {n[4:]: v for n, v in mx.load(str(ckpt / "model.safetensors")).items()
         if n.startswith("mtp.")}
    w.update({n: w[n] + 1.0 for n in centred})  # Qwen3.5 stores its RMSNorms as w - 1
    if config.get("num_experts"):
        w = {k.replace("model.layers.0.", "layers.0."): v for k, v in stack_experts(
            {k.replace("layers.0.", "model.layers.0."): v for k, v in w.items()},
            config["num_experts"]).items()}
    fc = nn.Linear(2 * h, h, bias=False)
    fc.weight = w["fc.weight"]
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = nn.RMSNorm(h, eps=config["rms_norm_eps"])
        norms[name].weight = w[f"{name}.weight"]
    layer = qwen3_5.DecoderLayer(args, args.full_attention_interval - 1)
    layer.load_weights([(n[len("layers.0."):], v) for n, v in w.items()
                        if n.startswith("layers.0.")], strict=True)
    cache = KVCache()
    embed = ref.model.embed_tokens

    def block(tokens, hid, mask):
        x = fc(mx.concatenate([norms["pre_fc_norm_embedding"](embed(mx.array(tokens)[None])),
                               norms["pre_fc_norm_hidden"](hid[None])], axis=-1))
        return norms["norm"](layer(x, mask, cache))[0]

    def argmax(x):
        return int(mx.argmax(ref.lm_head(x[-1:]), axis=-1).item())

    out = block(history[1:], hidden, "causal")
    drafts = [argmax(out)]
    for _ in range(k - 1):
        out = block([drafts[-1]], out[-1:], None)
        drafts.append(argmax(out))
    return drafts


@pytest.mark.parametrize("k,source", [(1, "safetensors"), (3, "safetensors"), (3, "gguf")])
def test_mtp_drafts_equal_mlx_lm_modules(tmp_path, k, source):
    """From a checkpoint's mtp.* tensors, or from a GGUF file's extra layer (llama.cpp's
    layout: blk.{n}.nextn.*, norms stored 1 + w) holding the same block."""
    from qwen3_5_checkpoint import random_model, write_gguf

    from vllm_metal.models import load_model
    from vllm_metal.mtp import MtpDraft

    ckpt = write_checkpoint(tmp_path / "ckpt", seed=0, mtp=True)
    model_path = str(ckpt)
    if source == "gguf":
        model_path = str(write_gguf(random_model(seed=0), tmp_path / "m.gguf", mtp=True))
    ref = reference_model(ckpt)
    prompt = np.random.default_rng(3).integers(3, 320, 13).tolist()
    hidden = ref.model(mx.array(prompt)[None])[0]              # the target's final hidden states
    sampled = int(mx.argmax(ref.lm_head(hidden[-1:]), axis=-1).item())
    history = prompt + [sampled]
    want = _reference_chain(ckpt, ref, history, hidden, k)
    assert len(set(want)) > 1 or k == 1, want  # a chain that depends on its inputs

    draft = MtpDraft(load_model(model_path, "float32"), model_path, k, max_model_len=64)
    draft.allocate(BLOCK, NUM_BLOCKS, max_num_seqs=1)
    t = len(prompt)
    seqs = np.array([0, t], np.int32)
    fields = dict(positions=mx.arange(t, dtype=mx.int32), slot_mapping=mx.arange(t, dtype=mx.int64),
                  block_tables=mx.array([list(range(NUM_BLOCKS))], mx.int32),
                  seq_lens=mx.array([t], mx.int32), cu_seqlens_q=mx.array(seqs),
                  num_decode_seqs=0, max_seq_len=t, max_query_len=t,
                  logits_indices=mx.array([t - 1], mx.int32), kv_caches=None)
    draft.forward_step(None, fields, target_ctx=SimpleNamespace(hidden=hidden), req_ids=["a"])
    got = draft.propose_for(_Packer({"a": history}), ["a"], ["a"], 0)
    assert got.tolist() == [want]


def test_mtp_is_refused_without_the_block(tmp_path):
    from vllm_metal.models import load_model
    from vllm_metal.mtp import MtpDraft

    ckpt = write_checkpoint(tmp_path / "ckpt", seed=0)
    with pytest.raises(ValueError, match="no MTP block"):
        MtpDraft(load_model(str(ckpt), "float32"), str(ckpt), 2, max_model_len=64)


def test_mtp_drafts_of_a_moe_block_equal_mlx_lm_modules(tmp_path):
    """Qwen3.5-MoE: the MTP block's MLP is an MoE block (run on ops.fused_moe)."""
    from qwen3_5_checkpoint import MOE_CONFIG

    from vllm_metal.models import load_model
    from vllm_metal.mtp import MtpDraft

    ckpt = write_checkpoint(tmp_path / "ckpt", seed=0, config=MOE_CONFIG, mtp=True)
    ref = reference_model(ckpt)
    ref = getattr(ref, "language_model", ref)  # qwen3_5_moe's Model wraps the text model
    prompt = np.random.default_rng(5).integers(3, 320, 11).tolist()
    hidden = ref.model(mx.array(prompt)[None])[0]
    sampled = int(mx.argmax(ref.lm_head(hidden[-1:]), axis=-1).item())
    history = prompt + [sampled]
    want = _reference_chain(ckpt, ref, history, hidden, 3, MOE_CONFIG)
    assert len(set(want)) > 1, want
    draft = MtpDraft(load_model(str(ckpt), "float32"), str(ckpt), 3, max_model_len=64)
    draft.allocate(BLOCK, NUM_BLOCKS, max_num_seqs=1)
    t = len(prompt)
    fields = dict(positions=mx.arange(t, dtype=mx.int32), slot_mapping=mx.arange(t, dtype=mx.int64),
                  block_tables=mx.array([list(range(NUM_BLOCKS))], mx.int32),
                  seq_lens=mx.array([t], mx.int32), cu_seqlens_q=mx.array(np.array([0, t], np.int32)),
                  num_decode_seqs=0, max_seq_len=t, max_query_len=t,
                  logits_indices=mx.array([t - 1], mx.int32), kv_caches=None)
    draft.forward_step(None, fields, target_ctx=SimpleNamespace(hidden=hidden), req_ids=["a"])
    assert draft.propose_for(_Packer({"a": history}), ["a"], ["a"], 0).tolist() == [want]
