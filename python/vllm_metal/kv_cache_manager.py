"""vLLM's KV-cache manager interface over the C++ runtime's KvCacheManager.

vLLM's scheduler asks its ``KVCacheManager`` for prefix-cache hits, slots,
frees and statistics. ``CoreKVCacheManager`` answers every one of those calls
from ``_core.KvCacheManager`` (src/cpp/runtime/kv_cache_manager.h), which owns
the block pool, each request's block table and the prefix cache; this module
only translates: Request objects in, block-id lists out, and vLLM's statistics
and KV events around them. MetalScheduler (scheduler.py) installs it.

Block hashes are vLLM's own (``request.block_hashes``, from the algorithm
``--prefix-caching-hash-algo`` names); the pool keys on their first 16 bytes.

Supported layouts (what this platform's worker declares): one full-attention
group, prefix-cached or not; or a hybrid model's attention group (group 0,
cached) plus linear-attention (Mamba "none" mode) groups, never cached: the
state at a hit's end comes from the runner's checkpoints, and
StateCheckpointTable (state_checkpoints.py) trims hits to those. Features that need
vLLM's other managers (KV connectors, encoder caches, sliding-window or Mamba
"align" groups, KV residency metrics) are refused at startup by the platform.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from vllm_metal import _core
from vllm_metal.state_checkpoints import StateCheckpointTable

_NO_BLOCKS: list[int] = []
_ADMITTED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class BlockId(NamedTuple):
    """What vLLM's scheduler reads of a block in KVCacheBlocks: its id."""

    block_id: int
    block_hash: object = None
    is_null: bool = False


class IdBlocks(KVCacheBlocks):
    """KVCacheBlocks holding block ids per group (the scheduler only reads ids)."""

    def __init__(self, ids: tuple[list[int], ...]):
        self.ids = ids
        self._blocks = None

    @property
    def blocks(self):  # built only if something reads block objects
        if self._blocks is None:
            self._blocks = tuple([BlockId(b) for b in group] for group in self.ids)
        return self._blocks

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None):
        groups = self.ids if group_ids is None else tuple(self.ids[g] for g in group_ids)
        if allow_none and all(len(g) == 0 for g in groups):
            return None
        return tuple(list(g) for g in groups)

    def __add__(self, other: KVCacheBlocks) -> IdBlocks:
        return IdBlocks(tuple(a + b for a, b in zip(self.ids, other.get_block_ids())))

    def new_empty(self) -> IdBlocks:
        return IdBlocks(tuple([] for _ in self.ids))


def group_block_sizes(kv_cache_config: KVCacheConfig, max_model_len: int) -> list[int]:
    """Tokens per block of each group for the C++ manager: a state group's one block per
    request holds max_model_len (whatever block size it declares: hybrid.state_block_size).
    Refuses groups the C++ manager does not model."""
    sizes = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "none" or spec.num_speculative_blocks:
                raise ValueError(f"[vllm-metal] KV-cache group {i}: Mamba cache mode "
                                 f"'{spec.mamba_cache_mode}' is not supported by the C++ KV-cache manager")
            sizes.append(max_model_len)
            continue
        elif type(spec) is not FullAttentionSpec:
            raise ValueError(f"[vllm-metal] KV-cache group {i}: {type(spec).__name__} is not supported by "
                             "the C++ KV-cache manager (full attention and Mamba 'none' groups only)")
        sizes.append(spec.block_size)
    return sizes


class _GroupView(NamedTuple):
    """What vLLM's engine and scheduler read of a single-type manager."""

    kv_cache_spec: object
    block_size: int


class _CoordinatorView:
    """What vLLM's scheduler and engine read of the coordinator."""

    enable_partial_hash_hits = False

    def __init__(self, manager: "CoreKVCacheManager", kv_cache_config: KVCacheConfig):
        self._manager = manager
        self.single_type_managers = tuple(_GroupView(g.kv_cache_spec, g.kv_cache_spec.block_size)
                                          for g in kv_cache_config.kv_cache_groups)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks,
                                   **_unused) -> int:
        computed = list(new_computed_blocks[0]) if new_computed_blocks else []
        return self._manager.core.num_blocks_to_allocate(request_id, num_tokens,
                                                         [b.block_id for b in computed])


class CoreKVCacheManager:
    """The subset of vllm.v1.core.kv_cache_manager.KVCacheManager's interface
    that vLLM's Scheduler calls, answered by the C++ KvCacheManager."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, *, enable_caching: bool,
                 log_stats: bool, enable_kv_cache_events: bool, watermark: float = 0.0,
                 state_checkpoint_slots: int = 0) -> None:
        """state_checkpoint_slots: for hybrid models with caching on, the runner's
        checkpoint slots (HybridState); caching stays off for them without any."""
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        sizes = group_block_sizes(kv_cache_config, max_model_len)
        self.state_table = None
        if enable_caching and len(sizes) > 1:
            if not state_checkpoint_slots:
                enable_caching = False
            elif type(kv_cache_config.kv_cache_groups[0].kv_cache_spec) is not FullAttentionSpec:
                raise ValueError("[vllm-metal] hybrid prefix caching needs the attention layers in "
                                 "KV-cache group 0")
            else:
                self.state_table = StateCheckpointTable(state_checkpoint_slots, sizes[0])
        self.enable_caching = enable_caching
        self.core = _core.KvCacheManager(kv_cache_config.num_blocks, sizes,
                                         enable_caching=self.enable_caching,
                                         enable_events=enable_kv_cache_events)
        self.pool = self.core.pool
        self._extend = self.core.extend  # the per-step call, looked up once
        self.block_size = sizes[0]
        self.num_kv_cache_groups = len(sizes)
        self.log_stats = log_stats
        self.enable_kv_cache_events = enable_kv_cache_events
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.empty_kv_cache_blocks = IdBlocks(tuple([] for _ in sizes))
        self.hit_tokens = 0  # prefix-cache hit tokens adopted (for the shutdown log)
        # KV events: vLLM's full hash of each cached block (the pool keeps 16 bytes)
        self._events: list[KVCacheEvent] = []
        self._event_hash: dict[int, bytes] = {}
        # Flags vLLM's scheduler reads from its own manager
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids = ()
        self.coordinator = _CoordinatorView(self, kv_cache_config)

    # ---- statistics ---------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.pool.usage

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def estimate_cached_tokens(self, request: Request) -> int:
        if not self.enable_caching:
            return 0
        return self.core.num_cached_blocks(request.request_id) * self.block_size

    # ---- lookups and allocation ---------------------------------------------
    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None):
        """(hit blocks, hit tokens, shared-prefix boundary: always 0 with one cached group)."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1  # the last token is always computed
        hit = self.core.find_cached_prefix(request.block_hashes, max_cache_hit_length)
        if hit and self.state_table is not None:  # hybrid: only as far as a state is kept
            hit = hit[:self.state_table.usable_blocks(request, len(hit))]
        if not hit:
            return self.empty_kv_cache_blocks, 0, 0
        return IdBlocks((hit,)), len(hit) * self.block_size, 0

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> KVCacheBlocks | None:
        """vLLM's allocate_slots: slots for the computed, new and lookahead tokens, or None
        when they do not fit; then the request's final full blocks are cached."""
        if new_computed_blocks is None and not (full_sequence_must_fit or num_external_computed_tokens
                                                or num_encoder_tokens or delay_cache_blocks
                                                or num_new_computed_tokens or self.enable_kv_cache_events):
            # A running request (most calls): one C++ call.
            if num_new_tokens == 0:
                raise ValueError("num_new_tokens must be greater than 0 when there are no "
                                 "computed tokens to adopt")
            total = request.num_computed_tokens + num_new_tokens
            if self.watermark_blocks and has_scheduled_reqs and request.status in _ADMITTED:
                reserved_blocks += self.watermark_blocks
            slots = total + num_lookahead_tokens
            final = request.num_tokens
            fresh = self._extend(request.request_id, slots if slots < self.max_model_len else self.max_model_len,
                                 total if total < final else final, request.block_hashes, reserved_blocks)
            if fresh is None:
                return None
            return IdBlocks(fresh) if fresh else self.empty_kv_cache_blocks
        if num_external_computed_tokens or num_encoder_tokens or delay_cache_blocks:
            raise ValueError("[vllm-metal] KV connectors and encoder caches are not supported")
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no "
                             "computed tokens to adopt")
        rid = request.request_id
        computed = _NO_BLOCKS if new_computed_blocks is None else new_computed_blocks.get_block_ids()[0]
        total = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len) + num_new_tokens
        # The watermark keeps headroom when admitting waiting or preempted requests.
        reserve = reserved_blocks
        if has_scheduled_reqs and request.status in _ADMITTED:
            reserve += self.watermark_blocks
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if self.core.num_blocks_to_allocate(rid, full, computed) + reserve - reserved_blocks \
                    > self.pool.num_free_blocks:
                return None
        first_cached = 0
        if self.enable_kv_cache_events:
            first_cached = len(computed) if computed else self.core.num_cached_blocks(rid)
        # Drafts are not final: cache only up to the request's verified tokens.
        fresh = self.core.allocate_slots(rid, min(total + num_lookahead_tokens, self.max_model_len), computed,
                                         min(total, request.num_tokens), request.block_hashes, reserve)
        if fresh is None:
            return None
        if self.enable_kv_cache_events:
            self._record_events(request, first_cached)
        self.hit_tokens += num_new_computed_tokens
        if self.state_table is not None and new_computed_blocks is not None and (
                num_new_computed_tokens or request.num_computed_tokens == 0):
            self.state_table.admitted(rid, num_new_computed_tokens)
        return IdBlocks(fresh) if any(fresh) else self.empty_kv_cache_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        first, end = self.core.cache_blocks(request.request_id, num_computed_tokens, request.block_hashes)
        if self.enable_kv_cache_events and end > first:
            self._record_events(request, first)

    def free(self, request: Request) -> None:
        self.core.free(request.request_id)  # freeing evicts nothing: no events
        if self.state_table is not None:
            self.state_table.forget(request.request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        ids = self.core.block_ids(request_id)
        return IdBlocks(ids) if any(ids) else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.core.block_ids(request_id)

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int):
        ids = self.core.block_ids(request_id)
        return (ids[0][:cdiv(num_computed_tokens, self.block_size)],) + tuple(ids[1:])

    def create_kv_cache_blocks(self, blocks) -> KVCacheBlocks:
        ids = tuple([b.block_id for b in group] for group in blocks)
        return IdBlocks(ids) if any(ids) else self.empty_kv_cache_blocks

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups  # cascade attention is gone from vLLM

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.state_table is not None:
            self.state_table.clear()
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        if self.enable_kv_cache_events:
            self._record_events(None, 0)
        return True

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.pool.evict_cached(sorted(block_ids))

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    # ---- what vLLM's scheduler drains every step (nothing here) ----------------
    def new_step_starts(self) -> None:
        pass

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        pass  # full attention and one-block Mamba groups never drop blocks

    def take_new_block_ids(self) -> list[int]:
        return []  # the worker does not zero new blocks

    def take_kv_cache_block_copies(self):
        return [], []  # no copy-on-write: hits are whole blocks

    def take_boundary_state_offloads(self) -> dict:
        return {}

    # ---- KV events ------------------------------------------------------------
    def _record_events(self, request: Request | None, first_cached: int) -> None:
        """vLLM's event shapes: removals (and clears) from the pool, in order, then
        one BlockStored for the blocks this request just cached."""
        for ev in self.pool.take_events():
            if ev.kind == "removed":
                full = self._event_hash.pop(ev.block_id, None)
                if full is not None:
                    self._events.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(full)],
                                                     medium="GPU", group_idx=0))
            elif ev.kind == "all_cleared":
                self._event_hash.clear()
                self._events.append(AllBlocksCleared())
        if request is None:
            return
        end = self.core.num_cached_blocks(request.request_id)
        if end <= first_cached:
            return
        ids = self.core.block_ids(request.request_id)[0]
        hashes = request.block_hashes
        for i in range(first_cached, end):
            self._event_hash[ids[i]] = hashes[i]
        b = self.block_size
        extra = [generate_block_hash_extra_keys(request, i * b, (i + 1) * b, 0)[0]
                 for i in range(first_cached, end)]
        lora = request.lora_request
        spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self._events.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first_cached:end]],
            parent_block_hash=maybe_convert_block_hash(hashes[first_cached - 1]) if first_cached else None,
            token_ids=request.all_token_ids[first_cached * b:end * b],
            block_size=b,
            lora_id=lora.adapter_id if lora else None,
            medium="GPU",
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra),
            group_idx=0,
            session_id=request.session_id,
            kv_cache_spec_kind=get_kv_cache_spec_kind(spec).value,
            kv_cache_spec_sliding_window=get_kv_cache_spec_sliding_window(spec),
        ))
