"""Hybrid models (Qwen3.5: gated delta net + full attention) in the runner and the config.

vLLM sees two kinds of layers: full attention (FullAttentionSpec, paged KV blocks) and
linear attention (MambaSpec, one state "block" per request and group, mamba_cache_mode
"none"). Its KV-cache manager groups them (one attention group, one or more mamba
groups) and requires one page size for all groups: the attention block size is raised
until a block's page holds a state page, and the state page is padded to it
(align_block_size, the platform's update_block_size_for_backend hook).

State slots. We do not keep the state in vLLM's mamba blocks: their ids range over the
whole block pool (num_blocks, thousands), while at most max_num_seqs requests run at
once. Each linear layer keeps a compact StatePool of max_num_seqs slots and
HybridState maps request -> slot: a slot is taken when a request's first chunk runs
(position 0), carried across its chunked-prefill steps and decodes, and freed when it
finishes or is preempted. A request starts from position 0 with a zero state
(has_initial_state 0), or, on a prefix-cache hit, from a checkpoint of the state after
the hit's tokens, copied into its slot (load_checkpoints). The worker subtracts the pools' bytes from
the KV-cache budget (kv_plan.py: the runtime's geometry sizes them), so memory
accounting stays honest; the mamba groups' block ids still count in vLLM's pool (one
block per request and group), which is what vLLM's own accounting assumes.

Speculative decoding. A step with drafts advances a request's state over all of them;
when some are rejected the state must go back. The runner names the drafting requests
before the step (save_before_drafts); the linear layers then cut each such chunk where
its drafts begin and copy the state there into a second set of pools. After a rejection
the slot is restored from that copy (restore_slots): the state covers every token before
the drafts, and the runner replays only the kept drafts (fewer than k) in front of the
next step (model_runner.py), so the replay cannot grow over consecutive rejections. The
attention layers rewrite their KV rows for those positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from vllm_metal.log import get_logger

logger = get_logger(__name__)

def is_hybrid_config(hf_config) -> bool:
    from vllm_metal.models.qwen3_5_paged import MODEL_TYPES

    return getattr(hf_config, "model_type", None) in MODEL_TYPES


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def config_layer_specs(hf_text_config, dtype: str, tensor_parallel_size: int = 1) -> list:
    """One attention and one linear-attention layer of the model as _core.KvLayerSpecs,
    from the HF config (no model is loaded yet when the platform aligns the block size);
    with tensor parallelism, one rank's: its share of the KV and linear-attention heads."""
    from vllm_metal import _core, kv_plan
    from vllm_metal.models.qwen3_5_paged import state_shapes_of

    cfg = hf_text_config.to_dict() if hasattr(hf_text_config, "to_dict") else dict(hf_text_config)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"] // tensor_parallel_size
    return [_core.KvLayerSpec.full_attention(kv_heads, head_dim, dtype=dtype),
            kv_plan.linear_attention(state_shapes_of(cfg, tensor_parallel_size), dtype)]


def align_block_size(vllm_config) -> None:
    """The smallest multiple of the block size whose attention page holds a state page;
    the state page is padded to it (vLLM's rule for hybrid models, computed by the
    runtime's geometry, align_kv_pages, from the config: no vLLM model class is built on
    this platform)."""
    from vllm_metal import _core

    cache = vllm_config.cache_config
    model = vllm_config.model_config
    layers = config_layer_specs(model.hf_text_config, _dtype_name(model.dtype),
                                vllm_config.parallel_config.tensor_parallel_size)
    pages = _core.align_kv_pages(layers, cache.block_size or 16)
    if pages.block_size != cache.block_size:
        logger.info("vllm-metal: hybrid model: attention block size %d tokens, so that a "
                    "block's page (%d bytes) holds one request's state of a linear-attention "
                    "layer (%d bytes)", pages.block_size, pages.page_bytes, pages.state_page_bytes)
    cache.block_size = pages.block_size
    cache.mamba_page_size_padded = pages.page_bytes
    cache.mamba_block_size = state_block_size(cache, model.max_model_len)


def configure_prefix_caching(vllm_config) -> None:
    """Prefix caching stays as the user set it (vLLM's default: on). Our state groups
    keep vLLM's Mamba "none" mode (one block per request); the state at a cached
    prefix's end comes from the runner's checkpoint slots (state_checkpoints.py), not
    from vLLM's "align" mode."""
    from vllm_metal import envs

    cache = vllm_config.cache_config
    cache.mamba_cache_mode = "none"
    if cache.enable_prefix_caching and envs.VLLM_METAL_HYBRID_STATE_CHECKPOINTS == 0:
        logger.info("vllm-metal: prefix caching off for this hybrid model "
                    "(VLLM_METAL_HYBRID_STATE_CHECKPOINTS=0)")
        cache.enable_prefix_caching = False
    if vllm_config.model_config is not None:
        cache.mamba_block_size = state_block_size(cache, vllm_config.model_config.max_model_len)


def state_block_size(cache, max_model_len: int) -> int:
    """The block size the state groups declare. A request holds one state block whatever
    it says (Mamba "none" mode; kv_cache_manager.group_block_sizes), but vLLM hashes
    prompts in blocks of the groups' least common multiple: with prefix caching the
    state groups say the attention block size, so hashes fall on every attention block
    (else max_model_len, as vLLM's "none" mode has it)."""
    if cache.enable_prefix_caching and cache.block_size:
        return cache.block_size
    return max_model_len


def checkpoint_slots(vllm_config) -> int:
    """State checkpoint slots of a hybrid model with prefix caching
    (VLLM_METAL_HYBRID_STATE_CHECKPOINTS; 0 with caching off). A fixed number, so the
    scheduler's table and the runner's pool agree before any memory is measured; each
    costs one request's state."""
    from vllm_metal import envs

    if not vllm_config.cache_config.enable_prefix_caching:
        return 0
    return envs.VLLM_METAL_HYBRID_STATE_CHECKPOINTS


def kv_cache_spec(loaded, cache_config, max_model_len: int) -> dict:
    """Per vLLM layer name: FullAttentionSpec (attention layers) or MambaSpec (linear)."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    spec, hybrid = loaded.spec, loaded.hybrid
    dtype = getattr(torch, spec.dtype)
    block = cache_config.block_size
    attn = FullAttentionSpec(block_size=block, num_kv_heads=spec.num_kv_heads,
                             head_size=spec.head_dim, dtype=dtype)
    shapes = hybrid.state_shapes
    state = MambaSpec(block_size=cache_config.mamba_block_size or max_model_len,
                      shapes=(shapes.conv, shapes.ssm), dtypes=(dtype, torch.float32),
                      page_size_padded=cache_config.mamba_page_size_padded,
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="none")
    if state.real_page_size_bytes > attn.page_size_bytes:
        raise ValueError(
            f"[vllm-metal] hybrid model: a {block}-token attention page ({attn.page_size_bytes} "
            f"bytes) is smaller than one request's state ({state.real_page_size_bytes} bytes); "
            "the platform's block-size alignment did not run")
    out = {attention_layer_name(i): attn for i in hybrid.attention_layers}
    out.update({linear_layer_name(i): state for i in hybrid.linear_layers})
    return out


def attention_layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def linear_layer_name(i: int) -> str:
    return f"model.layers.{i}.linear_attn"


class HybridState:
    """The state pools and the request -> slot table of one runner."""

    def __init__(self, loaded, kv_cache_config, num_slots: int, speculative: bool = False,
                 checkpoint_slots: int = 0):
        from vllm.v1.kv_cache_interface import MambaSpec

        self.loaded = loaded
        groups = kv_cache_config.kv_cache_groups
        self.is_state_group = [isinstance(g.kv_cache_spec, MambaSpec) for g in groups]
        attn_groups = [g for g, s in enumerate(self.is_state_group) if not s]
        if len(attn_groups) != 1:
            raise ValueError(f"[vllm-metal] hybrid model: expected one attention KV-cache group, "
                             f"got {len(attn_groups)}")
        self.attention_group = attn_groups[0]
        wanted = {attention_layer_name(i) for i in loaded.hybrid.attention_layers}
        if set(groups[self.attention_group].layer_names) != wanted:
            raise ValueError("[vllm-metal] hybrid model: the attention KV-cache group does not "
                             "hold exactly the attention layers")
        self.num_slots = num_slots
        self.pools = loaded.model.make_state_pools(num_slots, getattr(mx, loaded.hybrid.conv_dtype))
        self.free = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest slot
        self.slot_of: dict[str, int] = {}
        self.state_len: dict[str, int] = {}  # tokens the request's state covers
        # speculative decoding: each slot's copy from before the last step that drafted
        self.saved = (loaded.model.make_state_pools(num_slots, getattr(mx, loaded.hybrid.conv_dtype))
                      if speculative else None)
        self.saved_len: dict[str, int] = {}  # tokens a saved copy covers
        self.drafts: dict[str, int] = {}     # the coming step's drafts per request
        # prefix caching: states after cached prefixes, slots chosen by the scheduler's
        # StateCheckpointTable (state_checkpoints.py); its plan for the coming step
        conv_dtype = getattr(mx, loaded.hybrid.conv_dtype)
        self.checkpoints = (loaded.model.make_state_pools(checkpoint_slots, conv_dtype)
                            if checkpoint_slots else None)
        self.plan = None

    def packer_groups(self, kv_cache_config, num_blocks: int) -> list:
        from vllm_metal import _core

        out = []
        for g, group in zip(self.is_state_group, kv_cache_config.kv_cache_groups):
            block = group.kv_cache_spec.block_size
            if g:  # one state block per request, no token slots
                out.append(_core.KvGroupSpec(block, num_blocks=num_blocks, paged=False))
            else:
                out.append(_core.KvGroupSpec(block, num_blocks=num_blocks))
        return out

    def save_before_drafts(self, num_drafts: dict[str, int]) -> None:
        """The coming step's drafting requests and their draft counts: their states are
        saved where the drafts begin (the pass is cut there), for restore_slots."""
        if self.saved is None:
            raise RuntimeError("[vllm-metal] drafts on a hybrid runner built without "
                               "speculative decoding")
        self.drafts = {r: int(n) for r, n in num_drafts.items() if n > 0}

    def restore_slots(self, req_ids: list[str]) -> None:
        """The requests' states back to their saved copies (the tokens before the drafts)."""
        idx = mx.array(np.array([self.slot_of[r] for r in req_ids], np.int32))
        for pool, saved in zip(self.pools, self.saved):
            if pool is not None:
                pool.conv = _set_rows(pool.conv, idx, saved.conv[idx])
                pool.ssm = _set_rows(pool.ssm, idx, saved.ssm[idx])
        for r in req_ids:
            self.state_len[r] = self.saved_len[r]

    def release(self, req_ids) -> None:
        """Finished or preempted requests give their slots back."""
        for r in req_ids:
            slot = self.slot_of.pop(r, None)
            self.state_len.pop(r, None)
            self.saved_len.pop(r, None)
            if slot is not None:
                self.free.append(slot)

    def take_plan(self, plan) -> None:
        """The scheduler's checkpoint loads and writes for the coming step (a StatePlan,
        or None: none)."""
        if plan and self.checkpoints is None:
            raise RuntimeError("[vllm-metal] the scheduler planned state checkpoints but the "
                               "runner keeps none")
        self.plan = plan or None

    def step(self, req_ids: list[str], seq_lens: np.ndarray, cu_seqlens_q: np.ndarray):
        """Slots, has_initial_state and the rounds of one packed step (batch order); the
        state of each request then covers its seq_len tokens. A request resuming after a
        prefix-cache hit gets its checkpoint copied into its slot first."""
        n = len(req_ids)
        slots = np.empty(n, np.int32)
        has_init = np.empty(n, np.int32)
        loads = self.plan.loads if self.plan is not None else {}
        load_to, load_from = [], []
        for b, r in enumerate(req_ids):
            start = int(seq_lens[b]) - int(cu_seqlens_q[b + 1] - cu_seqlens_q[b])
            if start == 0 or (r in loads and self.state_len.get(r) != start):
                if r not in self.slot_of:
                    if not self.free:
                        raise RuntimeError(f"[vllm-metal] no free state slot for request {r!r} "
                                           f"({self.num_slots} slots = max_num_seqs)")
                    self.slot_of[r] = self.free.pop()
                has_init[b] = int(start > 0)
                if start > 0:
                    load_to.append(self.slot_of[r])
                    load_from.append(loads[r])
            else:
                if self.state_len.get(r) != start:
                    raise RuntimeError(
                        f"[vllm-metal] request {r!r} resumes at token {start} but its "
                        f"linear-attention state covers {self.state_len.get(r, 0)} tokens")
                has_init[b] = 1
            slots[b] = self.slot_of[r]
            self.state_len[r] = int(seq_lens[b])
        if load_to:
            self._load_checkpoints(np.array(load_to, np.int32), np.array(load_from, np.int32))
        rounds = self._rounds(req_ids, seq_lens, cu_seqlens_q, slots, has_init)
        self.plan, self.drafts = None, {}
        return slots, has_init, rounds

    def _load_checkpoints(self, to_slots: np.ndarray, from_slots: np.ndarray) -> None:
        dst, src = mx.array(to_slots), mx.array(from_slots)
        for pool, ckpt in zip(self.pools, self.checkpoints):
            if pool is not None:
                pool.conv[dst] = ckpt.conv[src]
                pool.ssm[dst] = ckpt.ssm[src]

    def _rounds(self, req_ids, seq_lens, cu_seqlens_q, slots, has_init) -> "StateRounds | None":
        """The linear layers' passes over this step's rows (models/qwen3_5_paged.py): one,
        unless a state must be saved inside a chunk (a prefix-cache checkpoint, or where a
        request's drafts begin); then the chunk is cut there, its pieces run in successive
        passes, and the state is copied out between them."""
        writes = self.plan.writes if self.plan is not None else {}
        if not writes and not self.drafts:
            return None
        cu = np.asarray(cu_seqlens_q)
        # per request: [(first row, rows, checkpoint slot after it or -1, save for drafts)]
        pieces = []
        for b, r in enumerate(req_ids):
            end = int(seq_lens[b])
            start = end - int(cu[b + 1] - cu[b])
            cuts = [start]
            save = {}
            for tokens, slot in writes.get(r, ()):
                if not start < tokens <= end:
                    raise RuntimeError(f"[vllm-metal] state checkpoint of request {r!r} after "
                                       f"{tokens} tokens is outside its chunk [{start}, {end})")
                cuts.append(tokens)
                save[tokens] = slot
            keep_at = -1
            if r in self.drafts:
                keep_at = end - self.drafts[r]
                if not start < keep_at < end:
                    raise RuntimeError(f"[vllm-metal] request {r!r}: {self.drafts[r]} drafts do "
                                       f"not fit its chunk [{start}, {end})")
                cuts.append(keep_at)
                self.saved_len[r] = keep_at
            cuts = sorted(set(cuts) | {end})
            pieces.append([(int(cu[b]) + lo - start, hi - lo, save.get(hi, -1), hi == keep_at)
                           for lo, hi in zip(cuts, cuts[1:])])
        rounds, rows_in_order = [], []
        for k in range(max(len(p) for p in pieces)):
            rows, cu_k, slots_k, init_k, save_from, save_to, keep = [], [0], [], [], [], [], []
            for b, p in enumerate(pieces):
                if k >= len(p):
                    continue
                first, count, ckpt, before_drafts = p[k]
                rows.append(np.arange(first, first + count, dtype=np.int32))
                cu_k.append(cu_k[-1] + count)
                slots_k.append(slots[b])
                init_k.append(has_init[b] if k == 0 else 1)
                if ckpt >= 0:
                    save_from.append(slots[b])
                    save_to.append(ckpt)
                if before_drafts:
                    keep.append(slots[b])
            rows = np.concatenate(rows)
            rows_in_order.append(rows)
            rounds.append(StateRound(
                rows=mx.array(rows), cu_seqlens=mx.array(np.array(cu_k, np.int32)),
                slots=mx.array(np.array(slots_k, np.int32)),
                has_initial_state=mx.array(np.array(init_k, np.int32)),
                save_from=_int32(save_from), save_to=_int32(save_to), keep=_int32(keep)))
        if len(rounds) == 1:
            rounds[0].rows = None  # every row, in order
            return StateRounds(rounds, None, self.checkpoints, self.saved)
        order = np.argsort(np.concatenate(rows_in_order), kind="stable").astype(np.int32)
        return StateRounds(rounds, mx.array(order), self.checkpoints, self.saved)

    def saved_arrays(self) -> list:
        """What the step writes besides the pools (checkpoints, states before drafts):
        evaluated with it, so no graph outlives the step."""
        pools = [c for c in (self.checkpoints or []) + (self.saved or []) if c is not None]
        return [(c.conv, c.ssm) for c in pools]


def _int32(values: list) -> mx.array | None:
    return mx.array(np.array(values, np.int32)) if values else None


@dataclass
class StateRound:
    """One pass of the linear layers over some of a step's rows."""

    rows: mx.array | None          # int32 packed rows of this pass (None: all, in order)
    cu_seqlens: mx.array           # int32 [n + 1] over those rows
    slots: mx.array                # int32 [n] state slots
    has_initial_state: mx.array    # int32 [n]
    save_from: mx.array | None     # state slots copied to checkpoint slots after the pass
    save_to: mx.array | None
    keep: mx.array | None = None   # state slots copied to the saved pools after the pass


@dataclass
class StateRounds:
    rounds: list[StateRound]
    order: mx.array | None         # int32: the passes' outputs, concatenated, back in row order
    checkpoints: list              # per layer: the checkpoint StatePool (None for attention)
    saved: list | None = None      # per layer: the saved StatePool (speculative decoding)


def _set_rows(pool: mx.array, idx: mx.array, rows: mx.array) -> mx.array:
    """pool with rows idx replaced (exactly: no arithmetic on the values)."""
    keep = mx.ones((pool.shape[0],), mx.bool_).at[idx].multiply(mx.zeros(idx.shape, mx.bool_))
    full = mx.zeros_like(pool).at[idx].add(rows)
    return mx.where(keep.reshape((-1,) + (1,) * (pool.ndim - 1)), pool, full)
