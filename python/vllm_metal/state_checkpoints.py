"""Exact prefix caching for hybrid models: which linear-attention states are checkpointed.

A prefix-cache hit on a hybrid model (Qwen3.5) must resume two things: the attention
layers' K/V (cached blocks of the C++ KvCacheManager's group 0) and every
linear-attention layer's recurrent state after exactly the hit's tokens. That state is
not in vLLM's blocks (hybrid.py keeps compact per-request slots), so the runner keeps a
pool of checkpoint slots beside them (HybridState.checkpoints), and this table, on the
scheduler's side, decides what each slot holds. The runner only follows the plan each
SchedulerOutput carries (``state_checkpoints``), so both sides agree by construction.

- Key: vLLM's hash of the prefix's last full block. It chains over every earlier token
  and the request's extra keys (cache salt, LoRA, multimodal), which is everything the
  state after those tokens depends on.
- Hits: the attention hit is trimmed to its longest prefix whose state is in the table.
  Only states written by an earlier step are in it: the runner executes steps in order,
  so a write planned with step N is done when step N + 1 runs (async scheduling too).
- Writes: each scheduled chunk's last block boundary (prompt chunks and decodes alike,
  so a conversation's next turn finds its reply), and the "junction" of a request whose
  attention hit went further than the checkpointed one: the boundary where its prompt
  leaves a cached one, where the next request sharing that prefix will look. The runner
  splits the chunk there (models/qwen3_5_paged.py). Never inside speculative drafts, and
  none for a request whose earlier drafts are still being verified (async scheduling):
  vLLM counts them as computed until their rejections come back, so where this chunk
  starts is not known yet.
- A write whose block hash is not known yet (async scheduling: the chunk's last token is
  still being sampled) holds its slot until the hash appears, then enters the table.
- Eviction: least recently used. Loads are applied before a step's writes, so a slot
  evicted and rewritten in the step that loads it is still read intact.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# A pending write whose hash has not appeared after this many steps is dropped (its
# request finished or was preempted before the token was kept).
PENDING_STEPS = 16


@dataclass
class StatePlan:
    """What the runner does with its checkpoint slots in one step: loads before the
    forward, then writes during it."""

    loads: dict[str, int] = field(default_factory=dict)              # request -> slot
    writes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # request -> [(tokens, slot)]

    def __bool__(self) -> bool:
        return bool(self.loads or self.writes)


@dataclass
class _Pending:
    request: object  # vllm Request: its block_hashes grow as tokens are kept
    tokens: int
    slot: int
    step: int


class StateCheckpointTable:
    def __init__(self, num_slots: int, block_size: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"[vllm-metal] state checkpoint slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self._table: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, oldest first
        self._free = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest slot
        self._pending: list[_Pending] = []
        self._hit: dict[str, int] = {}         # request -> tokens its adopted hit covers
        self._attention_hit: dict[str, int] = {}  # request -> tokens of its last attention hit
        self._junction: dict[str, int] = {}    # request -> boundary to checkpoint
        self._drafting: dict[str, int] = {}    # request -> its steps with drafts not yet read back
        self._step = 0
        self.stats = {"writes": 0, "loads": 0, "evictions": 0, "dropped": 0}

    # ---- hits (vLLM's get_computed_blocks / allocate_slots) -----------------------
    def usable_blocks(self, request, num_hit_blocks: int) -> int:
        """Of an attention hit of num_hit_blocks blocks, the leading blocks whose end
        state is checkpointed. Remembers the attention hit (a possible junction)."""
        self._attention_hit[request.request_id] = num_hit_blocks * self.block_size
        hashes = request.block_hashes
        for n in range(num_hit_blocks, 0, -1):
            if hashes[n - 1] in self._table:
                return n
        return 0

    def admitted(self, request_id: str, hit_tokens: int) -> None:
        """The scheduler admitted the request with a hit of hit_tokens (0: none): the
        runner loads that state, and the boundary where its attention hit ended, when
        further, becomes a junction to checkpoint."""
        if hit_tokens:
            self._hit[request_id] = hit_tokens
        attention = self._attention_hit.pop(request_id, 0)
        if attention > hit_tokens:
            self._junction[request_id] = attention

    def forget(self, request_id: str) -> None:
        """The request's blocks were freed (finished or preempted)."""
        self._hit.pop(request_id, None)
        self._attention_hit.pop(request_id, None)
        self._junction.pop(request_id, None)
        self._drafting.pop(request_id, None)

    def outputs_read(self, scheduler_output) -> None:
        """The scheduler read the outputs of the step `scheduler_output` planned: its
        requests' drafts are settled (kept or rolled back)."""
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if drafts and rid in self._drafting:
                self._drafting[rid] -= 1
                if not self._drafting[rid]:
                    del self._drafting[rid]

    def clear(self) -> None:
        """reset_prefix_cache: no checkpoint is found again (pending writes still land)."""
        self._free.extend(self._table.values())
        self._table.clear()

    # ---- one step's plan (after vLLM's schedule()) -----------------------------
    def plan(self, scheduler_output, requests: dict) -> StatePlan:
        out = StatePlan()
        scheduled = scheduler_output.num_scheduled_tokens
        b = self.block_size
        for rid in [r for r in self._hit if r in scheduled]:  # loads first: see the module doc
            request = requests[rid]
            tokens = self._hit.pop(rid)
            key = request.block_hashes[tokens // b - 1]
            slot = self._table[key]  # present: the hit was trimmed to the table this step
            self._table.move_to_end(key)
            out.loads[rid] = slot
            self.stats["loads"] += 1
        self._bind_pending()
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for rid, n in scheduled.items():
            request = requests.get(rid)
            if request is None:
                continue
            unsettled = rid in self._drafting  # this chunk's start may still move back
            if drafts.get(rid):
                self._drafting[rid] = self._drafting.get(rid, 0) + 1
            if unsettled:
                continue
            end = request.num_computed_tokens - len(drafts.get(rid, ()))  # final tokens only
            start = request.num_computed_tokens - n
            points = []
            junction = self._junction.get(rid)
            if junction is not None and junction <= end:
                del self._junction[rid]
                if junction > start:
                    points.append(junction)
            boundary = end // b * b
            if boundary > start and boundary not in points:
                points.append(boundary)
            for tokens in sorted(points):
                slot = self._write_slot(request, tokens)
                if slot is not None:
                    out.writes.setdefault(rid, []).append((tokens, slot))
        self._step += 1
        return out

    def _write_slot(self, request, tokens: int) -> int | None:
        """The slot the runner writes the state after `tokens` into, or None (already
        checkpointed, or every slot waits for a hash)."""
        index = tokens // self.block_size - 1
        hashes = request.block_hashes
        key = hashes[index] if index < len(hashes) else None
        if key is not None and key in self._table:
            self._table.move_to_end(key)
            return None
        if self._free:
            slot = self._free.pop()
        elif self._table:
            _, slot = self._table.popitem(last=False)
            self.stats["evictions"] += 1
        else:
            return None
        self.stats["writes"] += 1
        if key is None:
            self._pending.append(_Pending(request, tokens, slot, self._step))
        else:
            self._table[key] = slot
        return slot

    def _bind_pending(self) -> None:
        keep = []
        for p in self._pending:
            index = p.tokens // self.block_size - 1
            hashes = p.request.block_hashes
            if index < len(hashes):
                key = hashes[index]
                if key in self._table:
                    self._free.append(p.slot)  # the same state was written twice
                else:
                    self._table[key] = p.slot
            elif self._step - p.step > PENDING_STEPS:
                self._free.append(p.slot)
                self.stats["dropped"] += 1
            else:
                keep.append(p)
        self._pending = keep

    # ---- introspection (tests, logs) ----------------------------------------------
    def __len__(self) -> int:
        return len(self._table)

    @property
    def num_pending(self) -> int:
        return len(self._pending)
