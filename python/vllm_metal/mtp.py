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

Its KV cache is one attention layer shaped like the target's, indexed by the target's
block ids (as draft_model.py's), its bytes out of the same budget (draft_share).

When it runs. The block needs the token after each position, which for a step's last
rows is the token the step samples. So it runs after the step's tokens are read, in
propose: first one pass over every row of that step (the next tokens from the packer's
histories; rows past a request's kept tokens get a placeholder, and the next step
writes their positions again), which fills the block's cache for every computed
position; then, for the requests that sampled, draft 1 from the row of their last kept
input, and k - 1 decode passes, each feeding the block its own output (the target's
hidden state for those positions does not exist yet, as in vLLM). Drafts are the
argmax: the verifier's rejection rule keeps random sampling exact.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal.draft_model import held_block_tables
from vllm_metal.models import AttentionContext

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


@dataclass
class _StepRecord:
    """What pass 1 needs of a target step: its rows and the target's final hidden states."""

    req_ids: list
    positions: np.ndarray       # int64 [T]
    cu_seqlens_q: np.ndarray    # int64 [n + 1]
    fields: dict                # the step's AttentionContext fields (mx arrays)
    hidden: mx.array            # [T, hidden], lazy until the step is evaluated


class MtpDraft:
    """The runner's proposer for method "mtp" (the same role as draft_model.DraftModel)."""

    needs_target_hidden = True

    def __init__(self, target, model_path: str, num_speculative_tokens: int,
                 max_model_len: int) -> None:
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
        if args.num_experts:
            raise ValueError("[vllm-metal] speculative method 'mtp' for a Qwen3.5-MoE target "
                             "is not supported yet")
        first = next(layer.self_attn for layer in target.model.layers if not layer.is_linear)
        attn = lambda source: PagedGatedAttention(  # noqa: E731
            source, layer_idx=0, rotary_dim=first.rotary_dim, base=first.base,
            sections=first.sections)
        block = MtpBlock(args)
        dtype = getattr(mx, target.spec.dtype)  # the target's activations
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
            weights[name] = value.astype(dtype)
        block.load_weights(list(weights.items()), strict=True)
        block.finish(attn)
        block.eval()
        mx.eval(block.parameters())
        self.block = block
        self.lm = lm
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.kv_caches: list = []
        self.block_size = 0
        self._cache_shape = (first.num_kv_heads, first.head_dim)
        self._dtype = dtype
        self._steps: deque[_StepRecord] = deque()

    # ---- memory ---------------------------------------------------------------------------
    def bytes_per_block(self, block_size: int, max_num_seqs: int) -> int:
        heads, dim = self._cache_shape
        return 2 * block_size * heads * dim * self._dtype.size

    def allocate(self, block_size: int, num_blocks: int, max_num_seqs: int) -> str:
        heads, dim = self._cache_shape
        shape = (num_blocks, block_size, heads, dim)
        self.kv_caches = [(mx.zeros(shape, self._dtype), mx.zeros(shape, self._dtype))]
        mx.eval(self.kv_caches)
        self.block_size = block_size
        mib = self.bytes_per_block(block_size, max_num_seqs) * num_blocks / 2**20
        return f"MTP block, 1 attention layer ({mib:.1f} MiB)"

    # ---- each target step -----------------------------------------------------------------
    def forward_step(self, input_ids: mx.array, fields: dict, *, target_ctx=None,
                     req_ids=()) -> None:
        """Records the step (its rows, the target's hidden states) for propose."""
        if target_ctx is None or getattr(target_ctx, "hidden", None) is None:
            raise RuntimeError("[vllm-metal] mtp: the target step kept no hidden states")
        self._steps.append(_StepRecord(
            req_ids=list(req_ids), positions=np.array(fields["positions"], np.int64),
            cu_seqlens_q=np.array(fields["cu_seqlens_q"], np.int64), fields=fields,
            hidden=target_ctx.hidden))
        while len(self._steps) > 4:  # warm-up or unread steps: never proposed from
            self._steps.popleft()

    def step_arrays(self) -> list:
        """Evaluated with the step: the hidden states pass 1 reads later."""
        return [s.hidden for s in self._steps]

    # ---- proposing -----------------------------------------------------------------------
    def propose_for(self, packer, ids: list[str], step_req_ids: list[str], group: int) -> np.ndarray:
        """Pass 1 over the step that just sampled (step_req_ids), then greedy drafts [n, k']
        for the requests ids (-1 past a request's room)."""
        rec = self._take(step_req_ids)
        histories = {r: packer.token_ids(r) for r in rec.req_ids if r in packer}
        nxt = np.zeros(len(rec.positions), np.int32)
        for b, r in enumerate(rec.req_ids):
            h = histories.get(r)
            if h is None:
                continue
            lo, hi = int(rec.cu_seqlens_q[b]), int(rec.cu_seqlens_q[b + 1])
            want = rec.positions[lo:hi] + 1
            ok = want < len(h)
            nxt[lo:hi][ok] = np.asarray(h)[want[ok]]
        ctx = AttentionContext(**{**rec.fields, "kv_caches": self.kv_caches})
        out = self.block(self._embed(mx.array(nxt)), rec.hidden, ctx)        # [T, hidden]
        self.kv_caches = ctx.kv_caches
        n = len(ids)
        if n == 0:
            mx.eval(self.kv_caches)
            return np.zeros((0, 0), np.int64)
        # the row of each request's last kept input: position P - 1 (P: its newest token)
        where = {r: b for b, r in enumerate(rec.req_ids)}
        rows, newest = np.empty(n, np.int64), np.empty(n, np.int64)
        for i, r in enumerate(ids):
            b, p = where[r], len(histories[r]) - 1
            lo, hi = int(rec.cu_seqlens_q[b]), int(rec.cu_seqlens_q[b + 1])
            rows[i] = lo + (p - 1 - int(rec.positions[lo]))
            if not lo <= rows[i] < hi:
                raise RuntimeError(f"[vllm-metal] mtp: request {r!r} sampled position {p} "
                                   "outside its step's rows")
            newest[i] = p
        tables, num_blocks = held_block_tables(packer, ids, group)
        # draft j sits at P + j (below max_model_len); pass j >= 2 writes position P + j - 2
        room = np.minimum(self.max_model_len - 1 - newest, num_blocks * self.block_size - newest + 1)
        steps = int(min(self.k, room.max(initial=0)))
        drafts = np.full((n, max(steps, 0)), -1, np.int64)
        if steps <= 0:
            mx.eval(self.kv_caches)
            return drafts
        hidden = out[mx.array(rows)]
        ids_j = self._argmax(hidden)
        got = [ids_j]
        bs, seqs = self.block_size, np.arange(n + 1, dtype=np.int32)
        for j in range(2, steps + 1):
            pos = np.minimum(newest + j - 2, self.max_model_len - 1)
            width = int(pos.max()) // bs + 1
            table = tables[:, :width]
            slots = table[np.arange(n), np.minimum(pos // bs, width - 1)].astype(np.int64) * bs + pos % bs
            slots[j > room] = -1  # past a request's room: not written (the row is dropped)
            ctx = AttentionContext(
                positions=mx.array(pos.astype(np.int32)), slot_mapping=mx.array(slots),
                block_tables=mx.array(np.ascontiguousarray(table, np.int32)),
                seq_lens=mx.array((pos + 1).astype(np.int32)), cu_seqlens_q=mx.array(seqs),
                num_decode_seqs=n, max_seq_len=int(pos.max()) + 1, max_query_len=1,
                logits_indices=mx.array(seqs[:-1]), kv_caches=self.kv_caches)
            hidden = self.block(self._embed(ids_j), hidden, ctx)
            self.kv_caches = ctx.kv_caches
            ids_j = self._argmax(hidden)
            got.append(ids_j)
        values = np.array(mx.stack(got, axis=1))
        mx.eval(self.kv_caches)
        keep = np.arange(1, steps + 1)[None, :] <= room[:, None]
        drafts[keep] = values[keep]
        return drafts

    def _take(self, step_req_ids: list[str]) -> _StepRecord:
        while self._steps:
            rec = self._steps.popleft()
            if rec.req_ids == list(step_req_ids):
                return rec
        raise RuntimeError("[vllm-metal] mtp: no recorded target step for the step being read")

    def _embed(self, ids: mx.array) -> mx.array:
        return self.lm.model.embed_tokens(ids).astype(self._dtype)

    def _argmax(self, hidden: mx.array) -> mx.array:
        if self.lm.args.tie_word_embeddings:
            logits = self.lm.model.embed_tokens.as_linear(hidden)
        else:
            logits = self.lm.lm_head(hidden)
        return mx.argmax(logits, axis=-1).astype(mx.int32)


def _flat_names(block: MtpBlock) -> list:
    from mlx.utils import tree_flatten

    return [(name, v.shape) for name, v in tree_flatten(block.parameters())]
