"""The worker side of vLLM's LoRA interface (add_lora / remove_lora / pin_lora /
list_loras) and each step's row -> slot mapping.

- CPU cache: parsed adapters by lora_int_id, least recently used first, at most
  --max-cpu-loras (pinned ones are never evicted). A request naming an adapter that
  is not cached (evicted, or never added) loads it from its lora_path.
- Slots: --max-loras device slots per projection (layers.LoraLinear). vLLM's scheduler
  puts at most max_loras distinct adapters in a step; a step's adapters keep their
  slots, new ones take the least recently used free slot.
"""

from __future__ import annotations

import collections

import mlx.core as mx
import numpy as np

from vllm_metal.lora.adapter import LoraAdapter, load_peft_adapter
from vllm_metal.lora.experts import ExpertLoraSlots
from vllm_metal.lora.gguf_adapter import is_gguf_file, load_gguf_adapter
from vllm_metal.lora.layers import LoraStep, install
from vllm_metal.log import get_logger

logger = get_logger(__name__)


class LoraManager:
    def __init__(self, model, lora_config, max_position_embeddings: int | None = None,
                 num_layers: int | None = None):
        """num_layers: the checkpoint's (a pipeline stage holds some of them: its adapter
        weights are its own layers', the others' are checked by their stages)."""
        self.max_loras = int(lora_config.max_loras)
        self.max_rank = int(lora_config.max_lora_rank)
        self.max_cpu_loras = int(lora_config.max_cpu_loras or self.max_loras)
        self.max_position_embeddings = max_position_embeddings
        from vllm_metal.models.paged_model import PagedCausalLM
        from vllm_metal.models.qwen3_5_paged import PagedQwen3_5

        if not isinstance(model, (PagedCausalLM, PagedQwen3_5)):
            raise ValueError(f"[vllm-metal] LoRA runs on llama-family, qwen3 and Qwen3.5 models, "
                             f"not on {type(model).__name__}")
        self.step = LoraStep()
        first = getattr(model, "pipeline_stage", (0, None))[0]
        self.stage = range(first, first + len(model.layers))
        self.num_layers = num_layers or first + len(model.layers)
        self.layers = install(model, self.max_loras, self.max_rank, self.step, first)
        self.shapes = {}
        for k, m in self.layers.items():
            if isinstance(m, ExpertLoraSlots):  # one entry per expert's gate / up / down
                self.shapes.update(m.shapes())
            else:
                self.shapes[k] = (m.in_features, m.out_features)
        self.arch = getattr(model, "arch", None)  # None: Qwen3.5
        # Qwen3.5: (key heads, value heads, key head dim, value head dim) of the gated delta
        # net, for GGUF adapters in llama.cpp's value-head order (gguf_adapter.py)
        gdn = next((l.linear_attn for l in model.layers if hasattr(l, "linear_attn")), None)
        self.linear_heads = None if gdn is None else (
            int(gdn.num_k_heads), int(gdn.num_v_heads), int(gdn.head_k_dim), int(gdn.head_v_dim))
        attn = next((l.self_attn for l in model.layers if hasattr(l, "self_attn")), None)
        # llama GGUF adapters' lora_b rows of q/k are un-permuted per head (gguf_adapter.py)
        self.qk_heads = {} if attn is None else {"q_proj": int(attn.num_heads),
                                                 "k_proj": int(attn.num_kv_heads)}
        self.cpu: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()
        self.pinned: set[int] = set()
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> slot, LRU
        self.request_lora: dict[str, object] = {}  # req_id -> LoRARequest

    # ---- vLLM's worker interface ---------------------------------------------------
    def add(self, lora_request) -> bool:
        """Parses and checks the adapter (ValueError naming the problem), caches it."""
        lid = int(lora_request.lora_int_id)
        if lid in self.cpu and not getattr(lora_request, "load_inplace", False):
            self.cpu.move_to_end(lid)
            return True
        adapter = self._read(lora_request.lora_name, lora_request.lora_path)
        self.cpu[lid] = adapter
        self.cpu.move_to_end(lid)
        if lid in self.slot_of:  # reloaded in place: the slot gets the new weights
            self._write_slot(self.slot_of[lid], adapter)
        self._evict_cpu(keep=lid)
        return True

    def remove(self, lora_id: int) -> bool:
        lid = int(lora_id)
        self.pinned.discard(lid)
        found = self.cpu.pop(lid, None) is not None
        slot = self.slot_of.pop(lid, None)
        if slot is not None:
            self._write_slot(slot, None)
        return found

    def pin(self, lora_id: int) -> bool:
        if int(lora_id) not in self.cpu:
            return False
        self.pinned.add(int(lora_id))
        return True

    def list(self) -> set[int]:
        return set(self.cpu)

    # ---- requests and steps --------------------------------------------------------
    def request_added(self, req_id: str, lora_request) -> None:
        if lora_request is None or int(lora_request.lora_int_id) <= 0:
            self.request_lora.pop(req_id, None)
        else:
            self.request_lora[req_id] = lora_request

    def requests_removed(self, req_ids) -> None:
        for r in req_ids:
            self.request_lora.pop(r, None)

    def begin_step(self, req_ids: list[str], cu_seqlens_q: np.ndarray) -> None:
        """Sets the row -> slot mapping for a step of the packed sequences req_ids
        (sequence i owns rows [cu[i], cu[i+1]))."""
        slots_per_seq = np.full(len(req_ids), -1, np.int32)
        needed = {}
        for i, r in enumerate(req_ids):
            lr = self.request_lora.get(r)
            if lr is not None:
                needed.setdefault(int(lr.lora_int_id), []).append((i, lr))
        if not needed:
            self.step.row_slot, self.step.slots = None, frozenset()
            return
        if len(needed) > self.max_loras:  # the scheduler never does this
            raise ValueError(f"[vllm-metal] {len(needed)} LoRA adapters in one step, "
                             f"--max-loras is {self.max_loras}")
        for lid, users in needed.items():
            slot = self._activate(lid, users[0][1], keep=needed.keys())
            for i, _ in users:
                slots_per_seq[i] = slot
        lengths = np.diff(np.asarray(cu_seqlens_q))
        self.step.row_slot = mx.array(np.repeat(slots_per_seq, lengths).astype(np.int32))
        self.step.slots = frozenset(int(v) for v in slots_per_seq if v >= 0)

    def end_step(self) -> None:
        self.step.row_slot, self.step.slots = None, frozenset()

    # ---- internals -----------------------------------------------------------------
    def _read(self, name: str, path: str) -> LoraAdapter:
        """A PEFT directory, or a llama.cpp GGUF LoRA file."""
        if is_gguf_file(path):
            return load_gguf_adapter(name, path, self.shapes, self.max_rank, self.arch,
                                     self.qk_heads, self.linear_heads, self.stage, self.num_layers)
        return load_peft_adapter(name, path, self.shapes, self.max_rank,
                                 self.max_position_embeddings, self.stage, self.num_layers)

    def _activate(self, lid: int, lora_request, keep) -> int:
        if lid in self.slot_of:
            self.slot_of.move_to_end(lid)
            return self.slot_of[lid]
        adapter = self.cpu.get(lid)
        if adapter is None:
            self.add(lora_request)  # evicted from the CPU cache (or never added): reload
            adapter = self.cpu[lid]
        self.cpu.move_to_end(lid)
        used = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:  # the least recently used adapter this step does not need
            victim = next(v for v in self.slot_of if v not in keep)
            slot = self.slot_of.pop(victim)
        self.slot_of[lid] = slot
        self._write_slot(slot, adapter)
        return slot

    def _write_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        for key, layer in self.layers.items():
            if isinstance(layer, ExpertLoraSlots):  # picks its layer's experts' weights
                layer.write_slot(slot, None if adapter is None else adapter.weights)
            else:
                layer.write_slot(slot, None if adapter is None else adapter.weights.get(key))
            layer.sync()

    def _evict_cpu(self, keep: int) -> None:
        # an adapter evicted here may still sit in a slot: the slot keeps its weights
        while len(self.cpu) > self.max_cpu_loras:
            victim = next((v for v in self.cpu if v not in self.pinned and v != keep), None)
            if victim is None:
                break
            del self.cpu[victim]
            logger.info("LoRA adapter %d evicted from the CPU cache (--max-cpu-loras %d)",
                        victim, self.max_cpu_loras)
