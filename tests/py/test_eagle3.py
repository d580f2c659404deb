"""EAGLE3 heads (eagle3.py) on a tiny random llama target: the target's inner hidden
states as our forward keeps them against mlx-lm's layers, and the head's drafts against
a chain built from mlx-lm's modules (its llama Attention with a KVCache, nn.Linear,
nn.RMSNorm) over a random speculators-format checkpoint with a smaller draft vocabulary."""

from __future__ import annotations

import json
from dataclasses import fields
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from vllm_metal.models.testing import tiny_config, write_random_checkpoint

BLOCK, NUM_BLOCKS = 4, 16
AUX = [1, 3, 5]
DRAFT_VOCAB = 120


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    cfg = tiny_config("llama3", num_hidden_layers=6, eos_token_id=None)
    return cfg, str(write_random_checkpoint(cfg, tmp_path_factory.mktemp("target"), seed=3))


def write_head(out, target_cfg: dict, *, draft_vocab: int = DRAFT_VOCAB, aux=AUX, **kw):
    from vllm_metal.models.testing import write_random_eagle3_head

    return write_random_eagle3_head(out, target_cfg["hidden_size"], target_cfg["vocab_size"],
                                    draft_vocab=draft_vocab, aux=aux, **kw)


def _reference_streams(target_dir, tokens):
    """mlx-lm's llama over the tokens: its stream after each number of layers, and the
    final hidden states' greedy next token."""
    from mlx_lm.utils import load_model as mlx_lm_load

    lm, _ = mlx_lm_load(__import__("pathlib").Path(target_dir))
    h = lm.model.embed_tokens(mx.array(tokens)[None])
    streams = [h[0]]
    for layer in lm.model.layers:
        h = layer(h, "causal", None)
        streams.append(h[0])
    nxt = int(mx.argmax(lm.model.embed_tokens.as_linear(lm.model.norm(h[0, -1:]))
                        if lm.args.tie_word_embeddings else lm.lm_head(lm.model.norm(h[0, -1:]))).item())
    return lm, streams, nxt


def _reference_chain(lm, t, layer_cfg, history, aux, k, norm_before_residual):
    """Greedy EAGLE3 drafts after history from mlx-lm modules."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    g = {n.replace("midlayer.", "layers.0."): mx.array(v) for n, v in t.items()}
    args = llama.ModelArgs.from_dict(layer_cfg)
    attn = llama.Attention(args)
    attn.load_weights([(n[len("layers.0.self_attn."):], v) for n, v in g.items()
                       if n.startswith("layers.0.self_attn.")], strict=False)
    mlp = llama.MLP(args)
    mlp.load_weights([(n[len("layers.0.mlp."):], v) for n, v in g.items()
                      if n.startswith("layers.0.mlp.")])
    norms = {}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        norms[n] = nn.RMSNorm(layer_cfg["hidden_size"], eps=1e-5)
        norms[n].weight = g[f"layers.0.{n}.weight"]
    cache = KVCache()

    def layer(tokens, hid, mask):
        e = norms["input_layernorm"](lm.model.embed_tokens(mx.array(tokens)[None]))
        normed = norms["hidden_norm"](hid[None])
        r = (normed if norm_before_residual else hid[None]) + attn(
            mx.concatenate([e, normed], axis=-1), mask, cache)
        r = r + mlp(norms["post_attention_layernorm"](r))
        return mx.fast.rms_norm(r, g["norm.weight"], 1e-5)[0], r[0]

    def draft(x):
        d = int(mx.argmax(x[-1:] @ g["lm_head.weight"].T, axis=-1).item())
        return d + int(g["d2t"][d].item())

    fc = mx.concatenate(aux, axis=-1) @ g["fc.weight"].T
    out, feed = layer(history[1:], fc, "causal")
    drafts = [draft(out)]
    for _ in range(k - 1):
        out, feed = layer([drafts[-1]], feed[-1:], None)
        drafts.append(draft(out))
    return drafts


def _prefill_fields(t: int) -> dict:
    return dict(positions=mx.arange(t, dtype=mx.int32), slot_mapping=mx.arange(t, dtype=mx.int64),
                block_tables=mx.array([list(range(NUM_BLOCKS))], mx.int32),
                seq_lens=mx.array([t], mx.int32), cu_seqlens_q=mx.array(np.array([0, t], np.int32)),
                num_decode_seqs=0, max_seq_len=t, max_query_len=t,
                logits_indices=mx.array([t - 1], mx.int32))


@pytest.mark.parametrize("fused", [True, False])
def test_the_forward_keeps_the_inner_hidden_states_mlx_lm_has(target, fused):
    """Through the fused decoder layers and through the per-op layers."""
    from vllm_metal.draft_model import DraftModel
    from vllm_metal.models import AttentionContext

    _, path = target
    tokens = np.random.default_rng(1).integers(3, 300, 11).tolist()
    _, streams, _ = _reference_streams(path, tokens)
    host = DraftModel(path, "float32", 1, 64)  # the model and a KV cache to run it on
    host.allocate(BLOCK, NUM_BLOCKS, 1)
    assert bool(host.model._fused_layers())  # this build fuses the llama layers
    if not fused:
        object.__setattr__(host.model, "_fused_plan", [])  # no fused layers: the per-op path
    ctx = AttentionContext(**_prefill_fields(len(tokens)), kv_caches=host.kv_caches,
                           aux_layers=(0, 2, 6))
    host.model(mx.array(tokens), ctx)
    for got, n in zip(ctx.aux, (0, 2, 6)):
        np.testing.assert_allclose(np.array(got), np.array(streams[n]), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("speculators,norm_before_residual,k", [
    (True, True, 3), (True, False, 1), (False, False, 3)])
def test_eagle3_drafts_equal_mlx_lm_modules(tmp_path, target, speculators, norm_before_residual, k):
    from vllm_metal.eagle3 import Eagle3Draft
    from vllm_metal.models import load_model

    target_cfg, path = target
    head_dir, t, layer_cfg, keep = write_head(tmp_path / "head", target_cfg,
                                              norm_before_residual=norm_before_residual,
                                              speculators=speculators)
    prompt = np.random.default_rng(4).integers(3, 300, 13).tolist()
    lm, streams, sampled = _reference_streams(path, prompt)
    history = prompt + [sampled]
    aux = [streams[i] for i in AUX]
    want = _reference_chain(lm, t, layer_cfg, history, aux, k, norm_before_residual)
    assert set(want) <= set(keep.tolist())
    assert len(set(want)) > 1 or k == 1, want

    draft = Eagle3Draft(load_model(path, "float32"), str(head_dir), k, max_model_len=64)
    draft.allocate(BLOCK, NUM_BLOCKS, max_num_seqs=1)
    fields_ = {**_prefill_fields(len(prompt)), "kv_caches": None}

    class Packer:
        def __contains__(self, r):
            return r == "a"

        def token_ids(self, r):
            return list(history)

        def block_ids(self, r):
            return [list(range(NUM_BLOCKS))]

    draft.forward_step(None, fields_, target_ctx=SimpleNamespace(aux=aux), req_ids=["a"])
    got = draft.propose_for(Packer(), ["a"], ["a"], 0)
    assert got.tolist() == [want]


def test_unsupported_heads_are_refused(tmp_path, target):
    from vllm_metal.eagle3 import Eagle3Draft
    from vllm_metal.models import load_model

    target_cfg, path = target
    head_dir, *_ = write_head(tmp_path / "head", target_cfg)
    cfg = json.loads((head_dir / "config.json").read_text())
    cfg["norm_before_fc"] = True
    (head_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="norm_before_fc"):
        Eagle3Draft(load_model(path, "float32"), str(head_dir), 2, max_model_len=64)


def test_a_head_narrower_than_the_target_without_its_own_embedding_is_refused(tmp_path, target):
    from vllm_metal.eagle3 import Eagle3Draft
    from vllm_metal.models import load_model

    _, path = target
    head_dir, *_ = write_head(tmp_path / "head", {"hidden_size": 32, "vocab_size": 300})
    with pytest.raises(ValueError, match="hidden size 32 differs"):
        Eagle3Draft(load_model(path, "float32"), str(head_dir), 2, max_model_len=64)
