"""Multi-token prediction (speculative method "mtp"): the MTP block Qwen3.5 checkpoints
carry (`mtp.*` tensors) proposes each request's next tokens, verified by the target.

The block. Row q takes the target's final hidden state at position q and the token at
q + 1, and predicts the token at q + 2:
    x = fc([pre_fc_norm_embedding(embed(t[q+1])), pre_fc_norm_hidden(h[q])])
    x = one full-attention Qwen3.5 decoder layer (its own paged KV cache, position q)
    out = norm(x);  logits = the target's lm_head(out)
The embedding and lm_head are the target's. Norm weights are stored zero-centred, as
the target's are (the model multiplies by 1 + w); GGUF files (llama.cpp's qwen35: the
block as an extra layer, blk.{n}.nextn.*) store 1 + w.

Running it (after each step's tokens are read, one pass over the step's rows, then
k - 1 decode passes on its own output) and its KV cache: head_draft.py.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.head_draft import HeadDraft

_PREFIX = "mtp."


class MtpBlock(nn.Module):
    """Qwen3.5's MTP block over packed rows; parameter names are the checkpoint's
    without the "mtp." prefix."""

    def __init__(self, args):
        from mlx_lm.models import qwen3_5

        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        # a full-attention layer: mlx-lm's rule makes layer index interval - 1 one
        self.layers = [qwen3_5.DecoderLayer(args, args.full_attention_interval - 1)]
        self.norm = nn.RMSNorm(h, eps=eps)

    def finish(self, paged_attention) -> None:
        """After the weights are in: our RMSNorm op and the paged attention."""
        from vllm_metal.models.layers import RMSNorm as rms

        paged = paged_attention
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            setattr(self, name, rms.replacing(getattr(self, name)))
        layer = self.layers[0]
        layer.input_layernorm = rms.replacing(layer.input_layernorm)
        layer.post_attention_layernorm = rms.replacing(layer.post_attention_layernorm)
        layer.self_attn = paged(layer.self_attn)

    def __call__(self, embeds: mx.array, hidden: mx.array, ctx) -> mx.array:
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeds),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        layer = self.layers[0]
        positions3 = mx.broadcast_to(ctx.positions[None], (3, x.shape[0]))
        x = x + layer.self_attn(layer.input_layernorm(x), ctx, positions3)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def mtp_weights(model_path: Path) -> tuple[dict, bool]:
    """The checkpoint's MTP block, named as MtpBlock's parameters ({} when it has none),
    and whether its norms are stored zero-centred: safetensors mtp.* tensors (yes), or a
    qwen35 GGUF's extra layer (no: llama.cpp stores 1 + w)."""
    from vllm_metal.models.gguf_loader import GGUF_FILE_IN_DIR
    from vllm_metal.models.qwen3_5_loader import text_weight_name

    path = Path(model_path)
    gguf = path if path.suffix.lower() == ".gguf" else path / GGUF_FILE_IN_DIR
    if gguf.is_file() and not list(path.glob("*.safetensors")):
        from vllm_metal.models import gguf_loader, gguf_qwen35

        ckpt = gguf_loader.GGUFCheckpoint(str(gguf))
        return gguf_qwen35.mtp_weights(ckpt, gguf_qwen35.hf_config(ckpt)), False
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, value in mx.load(str(f)).items():
            name = text_weight_name(name)
            if name is not None and name.startswith(_PREFIX):
                out[name[len(_PREFIX):]] = value
    return out, True




class MtpHead:
    """The MTP block as head_draft.HeadDraft's head: fed the target's final hidden states
    (pass 1) or its own output (later passes); the target's embedding and lm_head."""

    name = "MTP block"

    def __init__(self, target, model_path: str) -> None:
        from vllm_metal.models.linear_choice import choose_dense_layers
        from vllm_metal.models.qwen3_5_paged import PagedGatedAttention

        lm = getattr(target.model, "lm", None)
        if target.hybrid is None or lm is None:
            raise ValueError("[vllm-metal] speculative method 'mtp' needs a Qwen3.5 target "
                             "(its checkpoint's mtp.* block)")
        weights, centred = mtp_weights(Path(model_path))
        if not weights:
            raise ValueError(f"[vllm-metal] speculative method 'mtp': the checkpoint {model_path} "
                             "has no MTP block (no mtp.* tensors)")
        args = lm.args
        if args.num_experts:  # Qwen3.5-MoE: the block's MLP is an MoE block like the model's
            from vllm_metal.models.qwen3_5_loader import stack_experts

            inner = "model.layers.0."
            stacked = stack_experts({(inner + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                                     for k, v in weights.items()}, args.num_experts)
            weights = {("layers.0." + k[len(inner):] if k.startswith(inner) else k): v
                       for k, v in stacked.items()}
        first = next(layer.self_attn for layer in target.model.layers if not layer.is_linear)
        block = MtpBlock(args)
        self.dtype = getattr(mx, target.spec.dtype)  # the target's activations
        want = dict(_flat_names(block))
        if set(weights) != set(want):
            missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
            raise ValueError(f"[vllm-metal] the checkpoint's MTP block does not match Qwen3.5's: "
                             f"missing {missing[:4]}, unexpected {extra[:4]}")
        for name, value in weights.items():
            if centred and "norm" in name and value.ndim == 1:
                value = value + 1.0  # every RMSNorm here is stored zero-centred
            if value.shape != want[name]:
                raise ValueError(f"[vllm-metal] mtp.{name}: shape {tuple(value.shape)}, the "
                                 f"model needs {tuple(want[name])}")
            weights[name] = value.astype(self.dtype)
        block.load_weights(list(weights.items()), strict=True)
        if args.num_experts:
            from types import SimpleNamespace

            from vllm_metal.models.moe import swap_moe_blocks

            swap_moe_blocks(SimpleNamespace(model=block))  # dense experts on ops.fused_moe
        block.finish(lambda source: PagedGatedAttention(
            source, layer_idx=0, rotary_dim=first.rotary_dim, base=first.base,
            sections=first.sections))
        choose_dense_layers(block, "gguf")  # on the CPU our GEMM, on Apple GPUs MLX's
        block.eval()
        mx.eval(block.parameters())
        self.block, self.lm = block, lm
        self.cache_shape = (first.num_kv_heads, first.head_dim)

    def prepare_target(self, ctx) -> None:
        ctx.keep_hidden = True  # qwen3_5_paged leaves the final hidden states in ctx.hidden

    def target_states(self, ctx) -> mx.array:
        if getattr(ctx, "hidden", None) is None:
            raise RuntimeError("[vllm-metal] mtp: the target step kept no hidden states")
        return ctx.hidden

    def first(self, embeds, states, ctx):
        out = self.block(embeds, states, ctx)
        return out, out

    def next(self, embeds, feed, ctx):
        out = self.block(embeds, feed, ctx)
        return out, out

    def embed(self, ids: mx.array) -> mx.array:
        return self.lm.model.embed_tokens(ids).astype(self.dtype)

    def draft_ids(self, hidden: mx.array) -> mx.array:
        if self.lm.args.tie_word_embeddings:
            logits = self.lm.model.embed_tokens.as_linear(hidden)
        else:
            logits = self.lm.lm_head(hidden)
        return mx.argmax(logits, axis=-1).astype(mx.int32)


def MtpDraft(target, model_path: str, num_speculative_tokens: int, max_model_len: int) -> HeadDraft:
    """The runner's proposer for method "mtp"."""
    return HeadDraft(MtpHead(target, model_path), num_speculative_tokens, max_model_len)


def _flat_names(block: MtpBlock) -> list:
    from mlx.utils import tree_flatten

    return [(name, v.shape) for name, v in tree_flatten(block.parameters())]
