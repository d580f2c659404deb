"""MetalModelRunner: one forward per scheduler step, on MLX.

Per step: apply the scheduler's deltas to the C++ request table, pack the
scheduled requests into flat arrays (BatchPacker, no per-step allocation),
build the attention context, and submit the forward lazily (execute_model);
sample_tokens then waits for it and the sampler (sampling/, per-request
parameters kept in a table by request row), and records the tokens.
The paged KV cache is one (key, value) pair of MLX arrays per layer, updated
in place by the attention layers through reshape_and_cache.

With async scheduling (vLLM's default) the engine schedules and submits step
N+1 while step N computes, so the host work of a step (scheduler, packing,
graph building, output processing) overlaps the forward of the previous one.
sample_tokens then returns at once (an AsyncModelRunnerOutput); the packer
holds a placeholder for each sampled token until the engine reads the step,
and step N+1's inputs take N's tokens from the lazy MLX array (input_sources).

Structured outputs: vLLM compiles each request's grammar and, after execute_model,
hands sample_tokens the step's bitmask (grammar_output). A step with such a request
keeps its logits unsampled until then; ops.apply_token_bitmask sets the forbidden
tokens to -inf and the sampler runs as for any step.

Speculative decoding (speculative.py): a decoding request's step carries draft tokens,
each scored by its own logits row; sampling/verify.py keeps the drafts the target
agrees with. Such a step's tokens are appended as soon as they are read, not deferred:
the next step's drafts come from them.
"""

from __future__ import annotations

import collections
import functools
import threading
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from vllm.v1.outputs import AsyncModelRunnerOutput

from vllm_metal import _core, envs, kv_plan, ops
from vllm_metal.expert_metrics import STATS_KEY, StatsWriter
from vllm_metal.models import AttentionContext, load_model
from vllm_metal.models.linear_choice import model_runs_on_gpu
from vllm_metal.sampling import Sampler, SamplingTable, custom_processors, gather_batch
from vllm_metal.sampling.batch import gather_draft_batch
from vllm_metal.sampling.verify import kept_tokens
from vllm_metal.speculative import Speculation
from vllm_metal.sampling.prompt_logprobs import PromptLogprobs
from vllm_metal.sampling.thinking_budget import ThinkingBudget
from vllm_metal.log import get_logger
from vllm_metal.scheduler_delta import DeltaHooks, SchedulerDelta

logger = get_logger(__name__)

_TORCH_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


@dataclass
class _SubmittedStep:
    """A step whose forward and sampling are submitted, its tokens not yet read."""
    req_ids: list[str]
    discard: np.ndarray  # bool [num_seqs]: partial prefill chunks
    result: object  # sampling.SampleResult: lazy tokens (and logprobs)
    prompt_scores: list
    tokens: np.ndarray | None = None  # int32 [num_seqs] once waited for
    # speculative steps: cu_num_logits [num_seqs + 1] (rows per request), and each
    # request's output once read
    cu_num_logits: np.ndarray | None = None
    outputs: list[list[int]] | None = None
    # pipeline parallel under async scheduling: the step's lazy sends (hidden state on, or
    # tokens back), held until its tokens are read
    sends: tuple = ()


@dataclass
class _UnsampledStep:
    """A step whose forward is submitted and whose sampling waits: for the grammar's
    bitmask when a row has structured output (vLLM computes it after execute_model)."""
    req_ids: list[str]
    discard: np.ndarray
    logits: mx.array  # [num_seqs, vocab], lazy
    batch: object  # sampling.SamplingBatch
    prompt_scores: list
    cu_num_logits: np.ndarray | None = None  # speculative steps


def _holding_step_lock(method):
    """Runs a runner method under the runner's step lock (see _AsyncStepOutput)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._step_lock:
            return method(self, *args, **kwargs)
    return locked


def apply_grammar_bitmask(logits: mx.array, req_ids: list[str], grammar_output,
                          vocab_size: int, cu_num_logits: np.ndarray | None = None,
                          mask_stride: int = 1) -> mx.array:
    """logits with the tokens the grammars forbid at -inf. grammar_output's bitmask has
    one block of mask_stride rows per structured-output request, in its own order (row j:
    the grammar after the request's first j drafts; vLLM's stride is 1 + the number of
    speculative tokens): each goes to its request's rows of this step (cu_num_logits:
    the step's rows per request, default one each; requests not in the step, if any, are
    skipped). vocab_size: what vLLM sized the masks for; logits past it (a padded lm
    head) are never allowed."""
    index = {r: i for i, r in enumerate(req_ids)}
    mask_rows, logit_rows = [], []
    for i, req_id in enumerate(grammar_output.structured_output_request_ids):
        if req_id in index:
            s = index[req_id]
            first, count = (s, 1) if cu_num_logits is None else (
                int(cu_num_logits[s]), int(cu_num_logits[s + 1] - cu_num_logits[s]))
            mask_rows += [i * mask_stride + j for j in range(count)]
            logit_rows += [first + j for j in range(count)]
    if not logit_rows:
        return logits
    bitmask = np.asarray(grammar_output.grammar_bitmask, np.int32)[mask_rows]
    if logits.shape[-1] > vocab_size:
        bitmask = _disallow_past(bitmask, vocab_size, logits.shape[-1])
    return ops.apply_token_bitmask(logits, mx.array(bitmask), mx.array(np.array(logit_rows, np.int32)))


def _disallow_past(bitmask: np.ndarray, vocab_size: int, width: int) -> np.ndarray:
    """The masks widened to `width` tokens, every id from vocab_size on disallowed (the
    backends leave the bits past their vocabulary set)."""
    words = -(-width // 32)
    out = np.zeros((bitmask.shape[0], words), np.uint32)
    out[:, :bitmask.shape[1]] = bitmask[:, :words].view(np.uint32)
    first = np.arange(words, dtype=np.int64) * 32  # each word's first token id
    keep = np.clip(vocab_size - first, 0, 32)
    out &= np.where(keep >= 32, np.uint32(0xFFFFFFFF),
                    ((np.uint64(1) << keep.astype(np.uint64)) - np.uint64(1)).astype(np.uint32))
    return out.view(np.int32)


class MetalModelRunner(DeltaHooks):
    def __init__(self, vllm_config, mlx_group=None) -> None:
        self.vllm_config = vllm_config
        # tensor parallel: the workers' mx.distributed group (mlx_ring.py); None: one process
        self.mlx_group = mlx_group
        self.tensor_parallel_size = vllm_config.parallel_config.tensor_parallel_size
        self.pipeline_parallel_size = vllm_config.parallel_config.pipeline_parallel_size
        self.pipeline = None  # models.pipeline_parallel.Stage with --pipeline-parallel-size > 1
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.scheduler_config = vllm_config.scheduler_config
        self.use_v2 = bool(getattr(vllm_config, "use_v2_model_runner", True))
        self.loaded = None
        self.expert_stats = None  # expert_metrics.StatsWriter with moe_expert_offload
        self.model = None
        self.kv_caches: list[tuple[mx.array, mx.array]] = []
        self.packer = None
        self.delta: SchedulerDelta | None = None  # the scheduler's deltas -> packer and hooks
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        # submitted, not yet handed to sample_tokens (unsampled: waits for a grammar bitmask)
        self._pending: _SubmittedStep | _UnsampledStep | None = None
        # async: submitted steps whose tokens are placeholders in the packer, oldest first
        self._deferred: collections.deque[_SubmittedStep] = collections.deque()
        self.sampling_table: SamplingTable | None = None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.sampler = None
        self.custom_processors = None  # sampling.custom_processors: --logits-processors
        self.speculation = Speculation.from_config(vllm_config)  # None: no drafts
        self._unread_spec_step: _SubmittedStep | None = None  # its tokens not yet appended
        self._gone: set[str] = set()  # requests the schedule being executed ended (no drafts)
        # hybrid models with drafts rejected: request -> the tokens its restored state
        # covers; its next step starts there (replays the kept tokens)
        self._replay: dict[str, int] = {}
        self.hybrid = None  # hybrid.HybridState for models with linear-attention layers
        self.attention_group = 0  # the KV-cache group of the attention layers
        self.kv_cache_description = "not allocated"  # for the startup summary
        # --runner pooling: pooling.Pooler (embeddings, classification); None: generation
        self.pooler = None
        self.lora = None  # lora.manager.LoraManager with --enable-lora
        self.encoder_batch = None  # encoder_batch.EncoderBatch for encoders (no KV cache)
        # vLLM's multiprocessing executor reads async outputs on a thread of its own, while
        # the next step runs: the runner's state changes under this lock
        self._step_lock = threading.Lock()
        # The stream the steps run on, this (the worker's) thread's. MLX streams belong to
        # the thread that made them: what get_output builds on vLLM's output thread (a
        # hybrid model's state restore after rejected drafts) must be built on this one,
        # or the next step cannot evaluate it ("There is no Stream(cpu, 1) in current thread").
        self._stream = mx.default_stream(mx.default_device())

    # ---- setup ------------------------------------------------------------------
    def load_model(self) -> None:
        dtype = _dtype_name(self.model_config.dtype)
        from vllm_metal.models.expert_offload import OffloadConfig

        additional = getattr(self.vllm_config, "additional_config", None) or {}
        with self._stage_layers_only():
            self.loaded = load_model(self.model_config.model, dtype,
                                     expert_offload=OffloadConfig.from_additional(additional))
        self.expert_stats = None  # the expert cache's counters -> /metrics (expert_metrics.py)
        if self.loaded.expert_cache is not None and additional.get(STATS_KEY):
            self.expert_stats = StatsWriter(additional[STATS_KEY], self.loaded.expert_cache)
        self.model = self.loaded.model
        if self.tensor_parallel_size > 1:
            self._shard_model()
        if self.pipeline_parallel_size > 1:
            from vllm_metal.models.pipeline_parallel import PipelineParallelError, keep_stage

            group = self.mlx_group
            try:
                self.pipeline = keep_stage(self.loaded, group.rank(), group.size(), group)
            except PipelineParallelError as e:
                raise ValueError(f"[vllm-metal] {self.model_config.model}: {e}") from None
            logger.info("vllm-metal pipeline stage %d of %d: layers %d-%d", self.pipeline.rank,
                        self.pipeline.size, self.pipeline.start, self.pipeline.stop - 1)
        spec = self.loaded.spec
        logger.info("vllm-metal loaded %s: %d layers, %d kv heads x %d, cache %s",
                    spec.architecture, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype)
        if getattr(self.model, "causal", True):  # encoders use varlen attention, not paged
            check_attention_head_size(self.model_config.model, spec.head_dim)
        if self.speculation is not None and self.speculation.method == "draft_model":
            self._load_draft_model(dtype)
        if self.speculation is not None and self.speculation.method in ("mtp", "eagle3"):
            self._load_draft_head()
        if self.vllm_config.lora_config is not None:
            from vllm_metal.lora.manager import LoraManager

            self.lora = LoraManager(self.model, self.vllm_config.lora_config,
                                    self.model_config.max_model_len,
                                    self.model_config.hf_text_config.num_hidden_layers)
        self._init_sampling()
        if self.model_config.runner_type == "pooling":
            self.pooler = build_pooler(self.model_config, self.scheduler_config, self.loaded)
            # vLLM's pooler heads (normalise, classifier, Dense projector) are the engine's
            # only torch ops, on [requests, hidden] rows: one thread runs them in ~0.2 ms at
            # 256 rows, where the OpenMP team vLLM sizes (OMP_NUM_THREADS) waited 2-17 ms on
            # threads that our kernel pool and the API server held (measured: docs/benchmarks.md)
            import torch

            torch.set_num_threads(1)
            # an encoder step's 25-100 MB buffers reused, not faulted in anew (host_memory.py)
            from vllm_metal.host_memory import keep_freed_memory

            keep_freed_memory()

    def _stage_layers_only(self):
        """Pipeline parallel: the load reads only this stage's layers (stage_loading.py);
        keep_stage then drops the others, unread."""
        import contextlib

        if self.pipeline_parallel_size == 1:
            return contextlib.nullcontext()
        from vllm.distributed.utils import get_pp_indices

        from vllm_metal.models.stage_loading import only_layers

        layers = self.model_config.hf_text_config.num_hidden_layers
        group = self.mlx_group
        return only_layers(range(*get_pp_indices(layers, group.rank(), group.size())))

    def _shard_model(self) -> None:
        """Keeps this rank's heads and MLP columns (models/tensor_parallel.py); its KV cache
        then holds its KV heads only."""
        from vllm_metal.models.tensor_parallel import TensorParallelError, shard_loaded

        try:
            shard_loaded(self.loaded, self.mlx_group)
        except TensorParallelError as e:
            raise ValueError(f"[vllm-metal] {self.model_config.model}: {e}") from None

    def _load_draft_head(self) -> None:
        """A head drafting from the target's hidden states (head_draft.py): the checkpoint's
        MTP block (mtp), or an EAGLE3 head from the speculative config's model (eagle3)."""
        k, max_len = self.speculation.num_speculative_tokens, self.model_config.max_model_len
        if self.speculation.method == "mtp":
            from vllm_metal.mtp import MtpDraft

            self.speculation.draft = MtpDraft(self.loaded, self.model_config.model, k, max_len)
            logger.info("vllm-metal loaded the checkpoint's MTP block")
            return
        from vllm_metal.eagle3 import Eagle3Draft

        path = self.vllm_config.speculative_config.draft_model_config.model
        self.speculation.draft = Eagle3Draft(self.loaded, path, k, max_len)
        logger.info("vllm-metal loaded the EAGLE3 head %s (target layers %s)", path,
                    self.speculation.draft.head.aux_layers)

    def _load_draft_model(self, dtype: str | None) -> None:
        from vllm_metal.draft_model import DraftModel

        path = self.vllm_config.speculative_config.draft_model_config.model
        draft = DraftModel(path, dtype, self.speculation.num_speculative_tokens,
                           self.model_config.max_model_len)
        check_attention_head_size(path, draft.loaded.spec.head_dim)
        self.speculation.draft = draft
        logger.info("vllm-metal loaded draft model %s: %d layers", draft.loaded.spec.architecture,
                    draft.loaded.spec.num_layers)

    @property
    def draft(self):
        return None if self.speculation is None else self.speculation.draft

    def kv_budget_share(self) -> float:
        """The part of the KV budget for the target's blocks (the rest: a draft model's
        cache over the same blocks, draft_model.py); 1 without a draft model."""
        if self.draft is None:
            return 1.0
        from vllm_metal.draft_model import draft_share

        return draft_share(self.cache_block_size_bytes(),
                           self.draft.bytes_per_block(self.cache_config.block_size,
                                                      self.scheduler_config.max_num_seqs))

    def _init_sampling(self) -> None:
        mode = str(getattr(self.model_config, "logprobs_mode", "raw_logprobs"))
        # unseeded requests draw their seeds from --seed (vLLM's default 0), as vLLM's workers
        # do: the same server command and requests give the same samples after a restart
        self.sampling_table = SamplingTable(self.model_config.get_vocab_size(),
                                            rows=self.scheduler_config.max_num_seqs,
                                            seed=getattr(self.model_config, "seed", None))
        self.prompt_logprobs = PromptLogprobs(self.sampling_table)
        self.thinking_budget = ThinkingBudget.from_config(self.vllm_config,
                                                          self.scheduler_config.max_num_seqs)
        self.native_sampling = envs.VLLM_METAL_NATIVE_SAMPLING
        if self.native_sampling:
            self.sampler = Sampler(mode)
        else:
            from vllm_metal.sampling.torch_sampler import TorchSampler

            self.sampler = TorchSampler(mode)
        self.logprobs_mode = mode
        self.custom_processors = custom_processors.load(self.vllm_config, self.use_v2,
                                                        self.scheduler_config.max_num_seqs)

    def layer_names(self) -> list[str]:
        first = self.pipeline.start if self.pipeline is not None else 0  # this stage's layers
        return [f"model.layers.{first + i}.self_attn.attn" for i in range(self.loaded.spec.num_layers)]

    def get_kv_cache_spec(self):
        import torch

        if not getattr(self.model, "causal", True):
            return {}  # an encoder keeps no KV cache: vLLM treats it as attention-free
        if self.loaded.hybrid is not None:
            from vllm_metal import hybrid

            return hybrid.kv_cache_spec(self.loaded, self.cache_config, self.model_config.max_model_len)
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = self.loaded.spec
        dtype = getattr(torch, _TORCH_DTYPES[spec.dtype])
        # Sliding-window layers are declared as full attention that records its
        # window: one KV group, blocks kept for all tokens, the window applied
        # by the kernel.
        return {
            name: FullAttentionSpec(
                block_size=self.cache_config.block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_dim,
                dtype=dtype,
                sliding_window=spec.sliding_window_per_layer[i] or None,
            )
            for i, name in enumerate(self.layer_names())
        }

    def _kv_sizing(self):
        """Bytes per block and state bytes (kv_plan: the C++ geometry), for vLLM's block size."""
        return kv_plan.size(self.loaded, block_size=self.cache_config.block_size,
                            max_num_seqs=self.scheduler_config.max_num_seqs,
                            speculative=self.speculation is not None)

    def _checkpoint_slots(self) -> int:
        """Hybrid models with prefix caching: the state checkpoint slots (hybrid.py)."""
        from vllm_metal.hybrid import checkpoint_slots

        if self.loaded is None or self.loaded.hybrid is None:
            return 0
        return checkpoint_slots(self.vllm_config)

    def cache_block_size_bytes(self) -> int:
        # hybrid models: only the attention layers have paged KV (state: state_memory_bytes)
        return self._kv_sizing().bytes_per_block

    def state_memory_bytes(self) -> int:
        """Memory the runner keeps outside vLLM's KV blocks (hybrid models' state slots)."""
        if self.loaded is None or self.loaded.hybrid is None:
            return 0
        return self._kv_sizing().state_bytes + kv_plan.checkpoint_bytes(
            self.loaded, block_size=self.cache_config.block_size, slots=self._checkpoint_slots())

    def initialize_kv_cache(self, kv_cache_config) -> None:
        """Paged KV for the attention layers, shaped by kv_plan for vLLM's block count; for
        hybrid models also the linear-attention layers' state slots (hybrid.py: why slots,
        not vLLM's block ids) and their KV-cache groups in the packer."""
        num_blocks = kv_cache_config.num_blocks
        if not getattr(self.model, "causal", True):
            from vllm_metal.encoder_batch import EncoderBatch

            self.encoder_batch = EncoderBatch()
            self.kv_cache_description = "none (encoder: whole prompts per step)"
            return
        if self.loaded.hybrid is not None:
            from vllm_metal.hybrid import HybridState

            self.hybrid = HybridState(self.loaded, kv_cache_config, self.scheduler_config.max_num_seqs,
                                      speculative=self.speculation is not None,
                                      checkpoint_slots=self._checkpoint_slots())
            self.attention_group = self.hybrid.attention_group
            block_size = kv_cache_config.kv_cache_groups[self.attention_group].kv_cache_spec.block_size
            kv_groups = self.hybrid.packer_groups(kv_cache_config, num_blocks)
        else:
            if len(kv_cache_config.kv_cache_groups) != 1:
                raise ValueError("[vllm-metal] models with several KV-cache groups are not supported yet")
            group = kv_cache_config.kv_cache_groups[0]
            missing = set(self.layer_names()) - set(group.layer_names)
            if missing:
                raise ValueError(f"[vllm-metal] KV cache config lacks layers {sorted(missing)[:3]}...")
            block_size = group.kv_cache_spec.block_size
            kv_groups = [_core.KvGroupSpec(block_size, num_blocks=num_blocks)]
        plan = kv_plan.plan(self.loaded, block_size=block_size, num_blocks=num_blocks,
                            max_num_seqs=self.scheduler_config.max_num_seqs,
                            speculative=self.speculation is not None)
        # per model layer: (K, V) each [num_blocks, block_size, kv_heads, head_dim]; None for
        # linear-attention layers (their state is in self.hybrid)
        self.kv_caches = [None if layer.kind == "linear_attention" else
                          (mx.zeros(layer.cache_shape, getattr(mx, layer.dtype)),
                           mx.zeros(layer.cache_shape, getattr(mx, layer.dtype)))
                          for layer in plan.layers]
        mx.eval([c for c in self.kv_caches if c is not None])
        self.packer = _core.BatchPacker(
            max_num_reqs=self.scheduler_config.max_num_seqs,
            max_num_batched_tokens=self._packer_token_budget(),
            max_model_len=self.model_config.max_model_len,
            kv_groups=kv_groups,
        )
        # the runner has never trimmed outputs to vLLM's count (scheduler_delta.py)
        self.delta = SchedulerDelta(self.packer, use_v2_model_runner=self.use_v2, hooks=self,
                                    trim_outputs=False)
        self.kv_cache_description = plan.description
        if self.draft is not None:
            self.kv_cache_description += "; draft model: " + self.draft.allocate(
                block_size, num_blocks, self.scheduler_config.max_num_seqs)
        if self.hybrid is not None and self.hybrid.checkpoints is not None:
            ckpt = kv_plan.checkpoint_bytes(self.loaded, block_size=block_size,
                                            slots=self._checkpoint_slots())
            self.kv_cache_description += (f"; {self._checkpoint_slots()} prefix-cache state "
                                          f"checkpoints ({ckpt / 2**20:.1f} MiB)")

    def _packer_token_budget(self) -> int:
        """The scheduler's tokens per step, plus room for hybrid models' replays of kept
        drafts under speculative decoding (fewer than k tokens per request: hybrid.py)."""
        budget = self.scheduler_config.max_num_batched_tokens
        if self.speculation is not None and self.loaded.hybrid is not None:
            budget += self.scheduler_config.max_num_seqs * self.speculation.num_speculative_tokens
        return budget

    def supported_tasks(self) -> tuple[str, ...]:
        return ("generate",) if self.pooler is None else self.pooler.supported_tasks()

    def warm_up(self) -> None:
        """One tiny forward so the first request does not pay one-time costs."""
        if self.encoder_batch is not None:  # no packer: one 2-token prompt straight through
            from types import SimpleNamespace

            ctx = SimpleNamespace(cu_seqlens_q=np.array([0, 2], np.int32),
                                  positions=np.arange(2, dtype=np.int32))
            mx.eval(self.model.hidden_states(mx.array([0, 1]), ctx, mx.array([0, 1])))
            return
        if self.packer is None:
            return
        num_groups = len(self.packer.block_table_widths)
        self.packer.add_request("__warmup__", [0, 1], block_ids=[[0]] * num_groups)
        try:
            self.packer.pack({"__warmup__": 2})
            out = self._forward(hidden_rows=np.arange(2, dtype=np.int32) if self.pooler else None)
            mx.eval(out, self.kv_caches, self._draft_caches())
        finally:
            self.packer.remove_requests(["__warmup__"])
            if self.hybrid is not None:
                self.hybrid.release(["__warmup__"])

    # ---- one step -----------------------------------------------------------------
    @_holding_step_lock
    def execute_model(self, scheduler_output):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        if self.pooler is not None:
            return self._execute_pooling(scheduler_output)
        if self._unread_spec_step is not None:  # async: this step's drafts come from it
            # requests this schedule ended or preempted get none: a draft model would
            # write its cache into blocks the scheduler may have handed on already
            self._gone = set(scheduler_output.finished_req_ids) | set(
                getattr(scheduler_output, "preempted_req_ids", None) or ())
            self._wait(self._unread_spec_step)
            self._gone = set()
        # the request table (both runner contracts: scheduler_delta.py), then the hooks above
        self.delta.update(scheduler_output)
        if self.pipeline is not None:
            self._append_tokens_sent_back(scheduler_output)
        if self.hybrid is not None:  # prefix caching's state loads and saves (hybrid.py)
            self.hybrid.take_plan(getattr(scheduler_output, "state_checkpoints", None))
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._pending = None
            return EMPTY_MODEL_RUNNER_OUTPUT
        p = self.packer
        # the packer keeps one deferred step besides this one (the engine reads step N
        # before it schedules N + 2)
        while len(self._deferred) > 1:
            self._wait(self._deferred[0])
        drafts = {}
        if self.speculation is not None:
            scheduled, drafts = self.speculation.step_drafts(scheduler_output)
            for r in [r for r in self._replay if r in scheduled]:
                # the kept tokens after the restored state go in front of this step's
                scheduled[r] += len(p.token_ids(r)) - 1 - self._replay.pop(r)
            p.pack(scheduled, drafts or None)
            if self.hybrid is not None and drafts:
                # their states are saved where the drafts begin: restored if one is rejected
                self.hybrid.save_before_drafts({r: len(d) for r, d in drafts.items()})
        else:
            p.pack(dict(scheduler_output.num_scheduled_tokens))
        source_step = self._deferred[-1] if p.num_input_sources else None
        if self.pipeline is not None and not self.pipeline.last:
            self._run_earlier_stage(source_step)
            return None
        table = self.sampling_table
        rows = np.array(p.req_rows)  # [num_seqs] batch index -> request row
        budgeted = self.thinking_budget is not None and self.thinking_budget.used(rows)
        if self._deferred and (table.needs_history[rows].any() or budgeted):
            self._wait(self._deferred[-1])  # penalties, bad words, budgets read the real tokens
        num_generated = np.array(p.seq_lens) - table.prompt_len[rows]
        cu_num_logits = None
        if drafts:
            step_drafts = [drafts.get(r, []) for r in p.req_ids]
            num_generated -= np.array([len(d) for d in step_drafts])
            cu_num_logits = np.array(p.cu_num_logits)
            batch = gather_draft_batch(table, rows, num_generated, step_drafts, p.token_ids)
        else:
            batch = gather_batch(table, rows, num_generated, p.token_ids,
                                 for_reference=not self.native_sampling)
        if budgeted:  # thinking_token_budget: end tokens forced (sampling/thinking_budget.py)
            batch.forced = self.thinking_budget.forced(rows, p.req_ids, p.token_ids)
            if batch.forced is not None and cu_num_logits is not None:  # budgeted rows have no drafts
                batch.forced = (cu_num_logits[batch.forced[0]].astype(np.int32), batch.forced[1])
        # prompt-logprob positions are scored after the sampled rows
        extra = self.prompt_logprobs.plan(rows, np.array(p.cu_seqlens_q), p.positions[:p.num_tokens])
        logits = self._forward(extra, self._input_ids(source_step))
        n = p.num_logits  # the sampled rows: one per request, plus one per draft
        sampled_logits = logits[:n] if len(extra) else logits
        if self.custom_processors is not None and self.custom_processors.step(
                list(p.req_ids), rows, np.array(p.seq_lens)):
            batch.custom = self.custom_processors  # runs on the host: sampled in sample_tokens
        prompt_scores = self.prompt_logprobs.score(logits[n:] if len(extra) else None,
                                                   self.logprobs_mode)
        step = _UnsampledStep(list(p.req_ids), np.array(p.discard_sampled), sampled_logits,
                              batch, prompt_scores, cu_num_logits)
        if table.structured[rows].any() or batch.custom is not None:
            # the grammars' bitmask for this step comes with sample_tokens: start the
            # forward now, sample then
            mx.async_eval(sampled_logits, self.kv_caches, self._checkpoint_arrays(),
                          self._draft_caches())
            self._pending = step
        else:
            self._submit(step)
        return None

    def _run_earlier_stage(self, source_step: _SubmittedStep | None) -> None:
        """Pipeline parallel, a stage before the last: its layers, the hidden state sent on;
        the last stage samples. With async scheduling the forward is submitted, not waited
        for, and the step's tokens, which the last stage sends back, wait as deferred
        samples, as the last stage's own do (models/pipeline_parallel.py)."""
        from vllm_metal.models import pipeline_parallel as pp

        if source_step is not None and getattr(source_step.result, "relay", None) is not None:
            # its tokens, which this step's inputs read lazily, go on to the previous stage
            # first: that stage may need them before it sends this step's hidden state
            mx.async_eval(source_step.result.relay)
        sent = self._forward(input_ids=self._input_ids(source_step))
        if not self.async_scheduling:  # the scheduler sends the tokens with the next step
            mx.eval(sent, self.kv_caches)
            return
        mx.async_eval(sent, self.kv_caches, self._checkpoint_arrays())
        p = self.packer
        received = pp.receive_sampled_tokens(self.pipeline, len(p.req_ids))
        p.defer_sampled()
        self._deferred.append(_SubmittedStep(list(p.req_ids), np.array(p.discard_sampled), received,
                                             [], sends=(sent,)))

    def _append_tokens_sent_back(self, scheduler_output) -> None:
        """Pipeline parallel: the tokens the last stage sampled, which vLLM's scheduler sends
        back to every stage with the step that needs them; appended where this stage's
        packer lacks them (the last stage has appended its own)."""
        cached = scheduler_output.scheduled_cached_reqs
        if not cached.new_token_ids:
            return
        p = self.packer
        for r, computed, new in zip(cached.req_ids, cached.num_computed_tokens, cached.new_token_ids):
            have = len(p.token_ids(r))
            if have < computed + len(new):
                p.append_tokens(r, list(new[have - computed:]))

    def _execute_pooling(self, scheduler_output):
        """A pooling step: the forward's final hidden states at the rows the pooler asks
        for, pooled at once; the output carries each finished request's pooled tensor
        (vLLM then finishes the request). Returned from execute_model, as vLLM's GPU
        runner does, so sample_tokens is not called."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        if self.encoder_batch is not None:
            return self._execute_encoder(scheduler_output)
        self.delta.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        p = self.packer
        p.pack(dict(scheduler_output.num_scheduled_tokens))
        req_ids = list(p.req_ids)
        plan = self.pooler.plan(req_ids, np.array(p.cu_seqlens_q), p.positions[:p.num_tokens])
        hidden = self._forward(hidden_rows=plan.rows)
        mx.eval(hidden, self.kv_caches)
        outputs = self.pooler.pool(plan, host_float32(hidden))
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 pooler_output=outputs)

    def _execute_encoder(self, scheduler_output):
        """An encoder's pooling step: the scheduled prompts, whole, through the encoder
        (encoder_batch.py); each request finishes in the step that runs it."""
        from types import SimpleNamespace

        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        gone = set(scheduler_output.finished_req_ids) | set(
            getattr(scheduler_output, "preempted_req_ids", None) or ())
        self.encoder_batch.drop(gone)
        self.pooler.drop(gone)
        for new in scheduler_output.scheduled_new_reqs:
            self.pooler.add(new.req_id, new.pooling_params, len(new.prompt_token_ids))
            self.encoder_batch.add(new.req_id, new.prompt_token_ids, new.pooling_params)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        step = self.encoder_batch.step(dict(scheduler_output.num_scheduled_tokens))
        plan = self.pooler.plan(step.req_ids, step.cu_seqlens, step.positions)
        ctx = SimpleNamespace(cu_seqlens_q=step.cu_seqlens, positions=step.positions)
        # MEAN / ALL pooling take every packed row in order: no gather copy of [T, hidden]
        rows = None if plan.takes_all_rows(len(step.input_ids)) else mx.array(plan.rows)
        hidden = self.model.hidden_states(mx.array(step.input_ids), ctx, rows,
                                          token_type_ids=mx.array(step.token_type_ids))
        mx.eval(hidden)
        outputs = self.pooler.pool(plan, host_float32(hidden))
        self.encoder_batch.drop(step.req_ids)  # finished: pooled whole
        return ModelRunnerOutput(req_ids=step.req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
                                 pooler_output=outputs)

    def _submit(self, u: _UnsampledStep, grammar_output=None) -> None:
        """Samples the step (lazily; the grammar's bitmask applied first) and submits it."""
        p = self.packer
        logits = u.logits
        if u.batch.custom is not None:
            if self._deferred:
                self._wait(self._deferred[-1])  # the processors read the real output tokens
            u.batch.custom.sync_outputs(p.token_ids)
        if grammar_output is not None:
            stride = 1 + (self.speculation.num_speculative_tokens if self.speculation else 0)
            logits = apply_grammar_bitmask(logits, u.req_ids, grammar_output,
                                           self.sampling_table.vocab_size, u.cu_num_logits, stride)
        result = self.sampler(logits, u.batch)
        if self.tensor_parallel_size > 1:
            result.tokens = tokens_of_rank_zero(result.tokens, self.mlx_group)
            if result.kept is not None:  # which drafts rank 0 kept, for every rank's next step
                result.kept = tokens_of_rank_zero(result.kept, self.mlx_group).astype(mx.bool_)
        sends = ()
        if self.pipeline is not None and self.async_scheduling:
            from vllm_metal.models.pipeline_parallel import send_sampled_tokens

            # the earlier stages' copy (without async scheduling vLLM's scheduler sends it)
            sends = (send_sampled_tokens(self.pipeline, result.tokens),)
        prompt_scores = u.prompt_scores
        # the caches too: fused layers hand them on as lazy arrays that depend on the step
        # (models/fused_layers.py); evaluated now, they hold their buffers alone next step
        mx.async_eval(result.tokens, *(result.logprobs or ()), *((result.kept,) if u.cu_num_logits is not None else ()),
                      *self.prompt_logprobs.arrays(prompt_scores), self.kv_caches,
                      self._checkpoint_arrays(), self._draft_caches(), sends)
        step = _SubmittedStep(u.req_ids, u.discard, result, prompt_scores, cu_num_logits=u.cu_num_logits,
                              sends=sends)
        if self.speculation is not None:
            # appended when read (next step's drafts come from them), never deferred
            self._unread_spec_step = step if self.async_scheduling else None
        elif self.async_scheduling:
            p.defer_sampled()
            self._deferred.append(step)
        self._pending = step

    @_holding_step_lock
    def sample_tokens(self, grammar_output):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        if isinstance(self._pending, _UnsampledStep):
            self._submit(self._pending, grammar_output)
        step, self._pending = self._pending, None
        if step is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self.async_scheduling:
            return _AsyncStepOutput(self, step)
        return self._step_output(step)

    def take_draft_token_ids(self):
        """The drafts proposed last (speculative decoding), for the engine; None without."""
        return None if self.speculation is None else self.speculation.take()

    def _step_output(self, step: _SubmittedStep):
        from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

        tokens = self._wait(step)
        sampled = step.outputs if step.outputs is not None else [
            [] if step.discard[i] else [int(tokens[i])] for i in range(len(step.req_ids))]
        logprobs = None
        if step.result.logprobs is not None:
            ids, lps, ranks = (np.array(a) for a in step.result.logprobs)
            if step.cu_num_logits is None:
                logprobs = LogprobsLists(ids, lps, ranks)
            else:  # the rows of the kept tokens, request after request
                keep = np.concatenate([np.arange(len(out)) + step.cu_num_logits[i]
                                       for i, out in enumerate(sampled)]).astype(np.int64)
                starts = np.concatenate([[0], np.cumsum([len(out) for out in sampled])])
                logprobs = LogprobsLists(ids[keep], lps[keep], ranks[keep], starts.tolist())
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs_dict=self.prompt_logprobs.collect(step.prompt_scores),
            prompt_token_id_logprobs_dict=self.prompt_logprobs.collect_token_ids(step.prompt_scores),
        )

    def _wait(self, step: _SubmittedStep) -> np.ndarray:
        """The step's tokens on the host (waits for its forward), recorded in the packer:
        appended (sync), or written over the placeholders of it and any older step (async)."""
        if step.tokens is not None:
            return step.tokens
        if self.speculation is not None:
            return self._read_speculative_step(step)
        if not self.async_scheduling:
            step.tokens = np.array(step.result.tokens, dtype=np.int32)
            self.packer.append_sampled(step.tokens)
            return step.tokens
        while step.tokens is None:
            oldest = self._deferred.popleft()
            oldest.tokens = _host_tokens(oldest.result)
            self.packer.resolve_deferred(oldest.tokens)
        return step.tokens

    def _read_speculative_step(self, step: _SubmittedStep) -> np.ndarray:
        """With speculative decoding: the step's tokens read, each request's output (its
        kept drafts and one more) appended in the packer, and the next drafts proposed."""
        tokens = np.array(step.result.tokens, dtype=np.int32)
        if step.cu_num_logits is None:
            outputs = [[int(t)] for t in tokens]
        else:
            outputs = kept_tokens(tokens, np.array(step.result.kept), step.cu_num_logits)
        outputs = [[] if step.discard[i] else out for i, out in enumerate(outputs)]
        width = max(len(out) for out in outputs) if outputs else 1
        rows = np.full((len(outputs), max(width, 1)), -1, np.int32)
        for i, out in enumerate(outputs):
            rows[i, :len(out)] = out
        self.packer.append_sampled(rows)
        step.tokens, step.outputs = tokens, outputs
        if self.hybrid is not None and step.cu_num_logits is not None:
            counts = np.diff(step.cu_num_logits)
            rejected = [r for r, out, n in zip(step.req_ids, outputs, counts) if 0 < len(out) < n]
            if rejected:  # their states went past the kept tokens: back to before the step
                self.hybrid.restore_slots(rejected)
                self._replay.update({r: self.hybrid.state_len[r] for r in rejected})
        if self._unread_spec_step is step:
            self._unread_spec_step = None
        self.speculation.propose(self.packer, step.req_ids, outputs, group=self.attention_group,
                                 skip=self._gone)
        return tokens

    def _checkpoint_arrays(self) -> list:
        """Hybrid models' state copies (prefix-cache checkpoints, states before drafts),
        evaluated with the step that writes them."""
        return [] if self.hybrid is None else self.hybrid.saved_arrays()

    def _draft_caches(self) -> list:
        """A draft model's caches (an MTP block: the hidden states it reads later),
        evaluated with the step that writes them."""
        return [] if self.draft is None else [self.draft.kv_caches, self.draft.step_arrays()]

    def _input_ids(self, source_step: _SubmittedStep | None) -> mx.array:
        """This step's token ids; where a row's input is the previous step's sample
        (async), that token, lazily when the previous step is still computing."""
        p = self.packer
        ids = p.input_ids[:p.num_tokens]
        if source_step is None:
            return mx.array(ids)
        sources = np.array(p.input_sources)
        rows = np.flatnonzero(sources >= 0)
        if source_step.tokens is not None:
            ids = ids.copy()
            ids[rows] = source_step.tokens[sources[rows]]
            return mx.array(ids)
        sampled = source_step.result.tokens.astype(mx.int32)[mx.array(sources[rows])]
        return mx.array(ids).at[mx.array(rows)].add(sampled)  # placeholders are 0

    def _forward(self, extra_logits_indices: np.ndarray | None = None,
                 input_ids: mx.array | None = None, hidden_rows: np.ndarray | None = None) -> mx.array:
        """extra_logits_indices: packed tokens whose logits are also wanted,
        returned after the sampled rows; input_ids: default the packer's.
        hidden_rows (pooling): return the final hidden states of these packed rows
        instead of logits."""
        p = self.packer
        t = p.num_tokens
        logits_indices = p.logits_indices
        if extra_logits_indices is not None and len(extra_logits_indices):
            logits_indices = np.concatenate([logits_indices, extra_logits_indices])
        g = self.attention_group
        fields = dict(
            positions=mx.array(p.positions[:t]),
            slot_mapping=mx.array(p.slot_mappings[g, :t] if g else p.slot_mapping[:t]),
            # only the columns this step's contexts reach (the table is max-model-len wide)
            block_tables=mx.array((p.block_tables[g] if g else p.block_table)
                                  [:, :max(1, p.block_table_used_widths[g])]),
            seq_lens=mx.array(p.seq_lens),
            cu_seqlens_q=mx.array(p.cu_seqlens_q),
            num_decode_seqs=p.num_decodes,
            max_seq_len=p.max_seq_len,
            max_query_len=p.max_query_len,
            logits_indices=mx.array(logits_indices),
            kv_caches=self.kv_caches,
        )
        if self.hybrid is not None:
            from vllm_metal.models.qwen3_5_paged import HybridContext

            cu = np.array(p.cu_seqlens_q)
            slots, has_init, rounds = self.hybrid.step(list(p.req_ids), np.array(p.seq_lens), cu)
            ctx = HybridContext(**fields, cu_seqlens_state=mx.array(cu), state_slots=mx.array(slots),
                                has_initial_state=mx.array(has_init), state_pools=self.hybrid.pools,
                                state_rounds=rounds)
        else:
            ctx = AttentionContext(**fields)
        if self.draft is not None:  # what a head drafting from the target's states reads
            self.draft.prepare_target(ctx)
        if input_ids is None:
            input_ids = mx.array(p.input_ids[:t])
        if self.lora is not None:  # each row's adapter slot (lora/manager.py)
            self.lora.begin_step(list(p.req_ids), np.array(p.cu_seqlens_q))
        try:
            if self.pipeline is not None:  # a stage: its layers' adapters
                return self._stage_forward(input_ids, ctx)
            if hidden_rows is not None:
                out = self.model.hidden_states(input_ids, ctx, mx.array(hidden_rows))
                self.kv_caches = ctx.kv_caches
                return out
            logits = self.model(input_ids, ctx)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        self.kv_caches = ctx.kv_caches  # the updated caches
        if self.expert_stats is not None:  # streamed layers evaluated in the forward
            self.expert_stats.write()
        if self.draft is not None:  # the same tokens into the draft's cache (draft_model.py)
            self.draft.forward_step(input_ids, fields, target_ctx=ctx, req_ids=list(p.req_ids))
        return logits

    def _stage_forward(self, input_ids: mx.array, ctx) -> mx.array:
        """Pipeline parallel: this stage's layers, between the previous stage's hidden state
        (received) and the next one (sent). Returns the logits on the last stage, else the
        lazy send."""
        from vllm_metal.models import pipeline_parallel as pp

        stage = self.pipeline
        carried = None
        if not stage.first:
            hidden = self.model.lm.model.norm.weight.shape[0]
            carried = pp.receive_from_previous(stage, int(input_ids.shape[0]), hidden,
                                               getattr(mx, self.loaded.spec.dtype))
        if stage.last:
            out = self.model(input_ids, ctx, carried)
        else:
            h, residual = self.model.stage_forward(input_ids, ctx, carried)
            out = pp.send_to_next(stage, h, residual)
        self.kv_caches = ctx.kv_caches
        return out

    # ---- the scheduler's deltas (SchedulerDelta applies them; these hooks follow) --------
    def requests_removed(self, removed: set[str], preempted: set[str]) -> None:
        if self.pooler is not None:  # preempted ones come back from token 0 (re-added)
            self.pooler.drop(removed | preempted)
            return
        if self.hybrid is not None:
            # V1 keeps preempted requests, but they restart from token 0: state recomputed
            self.hybrid.release(removed | preempted)
        if removed:
            self.sampling_table.remove(removed)
            self.prompt_logprobs.drop(removed)
            if self.custom_processors is not None:
                self.custom_processors.remove(removed)
            if self.speculation is not None:
                self.speculation.drop(removed)
        for r in removed | preempted:
            self._replay.pop(r, None)
        if self.lora is not None and removed:
            self.lora.requests_removed(removed)

    def request_added(self, new, row: int, tokens: list[int], prompt_len: int) -> None:
        if self.lora is not None:
            self.lora.request_added(new.req_id, getattr(new, "lora_request", None))
        if self.pooler is not None:
            self.pooler.add(new.req_id, new.pooling_params, prompt_len)
            return
        self.prompt_logprobs.drop([new.req_id])
        self.sampling_table.add(row, new.req_id, new.sampling_params,
                                new.prompt_token_ids or tokens, prompt_len,
                                resumed=len(tokens) > prompt_len)
        if self.thinking_budget is not None:
            self.thinking_budget.add(row, new.sampling_params)
        if self.speculation is not None:
            budgeted = self.thinking_budget is not None and self.thinking_budget.used(np.array([row]))
            self.speculation.add(new.req_id, new.sampling_params, drafts=not budgeted)
        if self.custom_processors is not None:
            self.custom_processors.add(new.req_id, new.sampling_params, tokens[:prompt_len],
                                       tokens[prompt_len:], row=row)

    def computed_tokens(self, req_ids: list[str], computed: list[int]) -> list[int]:
        """With speculative decoding, vLLM's counts corrected for rejected drafts and for
        hybrid models' replays (a restored state covers fewer tokens)."""
        if self.speculation is None:
            return computed
        p = self.packer
        computed = self.speculation.computed_tokens(
            req_ids, computed, lambda r: len(p.token_ids(r)) if r in p else 1 << 30)
        return [self._replay.get(r, c) for r, c in zip(req_ids, computed)]


class _AsyncStepOutput(AsyncModelRunnerOutput):
    """What sample_tokens returns under async scheduling: the engine calls
    get_output() when it needs the step, by which time the next step is submitted; on
    another thread under the multiprocessing executor (the output rank's
    WorkerAsyncOutputCopy thread)."""

    def __init__(self, runner: MetalModelRunner, step: _SubmittedStep):
        self._runner = runner
        self._step = step

    def get_output(self):
        # wait for the step's forward without the lock (the next step is built meanwhile),
        # then record its tokens under it
        mx.eval(self._step.result.tokens)
        with self._runner._step_lock, mx.stream(self._runner._stream):
            return self._runner._step_output(self._step)

    def get_kv_connector_output(self):
        return None


def host_float32(hidden: mx.array) -> np.ndarray:
    """An evaluated array as a float32 NumPy copy that owns its memory (pooled outputs may
    be views of it); a float32 array is copied once, without MLX's astype pass before."""
    return np.array(hidden if hidden.dtype == mx.float32 else hidden.astype(mx.float32))


def _host_tokens(result) -> np.ndarray:
    """A deferred step's tokens on the host. An earlier pipeline stage's copy
    (pipeline_parallel.ReceivedTokens) goes on to the stage before it at the same time,
    so that every stage reads and hands on the steps in order."""
    relay = getattr(result, "relay", None)
    if relay is not None:
        mx.eval(result.tokens, relay)
    return np.array(result.tokens, dtype=np.int32)


def tokens_of_rank_zero(tokens: mx.array, group) -> mx.array:
    """Rank 0's sampled tokens on every rank (lazily: an all-sum with zeros elsewhere). The
    ranks hold the same logits, but random sampling draws on each rank's own generator:
    every rank must feed the next step the tokens the engine receives (rank 0's). The other
    ranks send their own times 0, not fresh zeros: the all-sum must depend on the step's
    forward, or MLX may run it before the forward's all-sums, out of step with rank 0."""
    mine = tokens.astype(mx.int32)
    return mx.distributed.all_sum(mine if group.rank() == 0 else mine * 0, group=group)


def build_pooler(model_config, scheduler_config, loaded):
    """The pooling.Pooler of a `--runner pooling` model: a classifier (score layer) for
    *ForSequenceClassification checkpoints and `--convert classify`, else an embedder."""
    from vllm_metal.models.loader import is_sequence_classifier, score_weights
    from vllm_metal.models.token_classifier import classifier_method
    from vllm_metal.pooling import Pooler, score_classifier

    causal = getattr(loaded.model, "causal", True)  # pooling.HiddenStateSource
    if not causal and scheduler_config.enable_chunked_prefill:
        raise ValueError(f"[vllm-metal] {model_config.model} attends both ways: chunked prefill cannot "
                         "serve it (--no-enable-chunked-prefill)")
    from_tokens = classifier_method(model_config.hf_config)  # Qwen3-Reranker-style (--hf-overrides)
    classify = (from_tokens is not None or is_sequence_classifier(loaded.hf_config)
                or model_config.convert_type == "classify")
    if not classify:
        from vllm.model_executor.models.adapters import _load_st_projector

        # sentence-transformers Dense layers (EmbeddingGemma), loaded as vLLM's own poolers do
        return Pooler(model_config, causal=causal, projector=_load_st_projector(model_config))
    if not causal:  # a cross-encoder: its own head on the first token (models/bert.py)
        if model_config.pooler_config.seq_pooling_type not in (None, "CLS"):
            raise ValueError(f"[vllm-metal] {model_config.model}: a cross-encoder pools the first token "
                             f"(CLS), not {model_config.pooler_config.seq_pooling_type}")
        return Pooler(model_config, loaded.model.torch_classifier(model_config.head_dtype), causal=False)
    if from_tokens is not None:
        weight = _score_from_tokens(model_config, loaded, *from_tokens)
        return Pooler(model_config, score_classifier(weight, None, model_config.head_dtype), causal=causal)
    score = score_weights(model_config.model)
    if score is None:
        raise ValueError(f"[vllm-metal] {model_config.model}: a classification model needs a score "
                         "layer (score.weight) in its safetensors checkpoint")
    weight, bias = score
    return Pooler(model_config, score_classifier(weight, bias, model_config.head_dtype), causal=causal)


def _score_from_tokens(model_config, loaded, method: str, tokens: list[str]):
    """The score layer of an LM served as a classifier from its vocabulary
    (models/token_classifier.py), with the token ids of the served tokenizer."""
    from vllm.tokenizers import get_tokenizer

    from vllm_metal.models.token_classifier import score_weight_from_tokens, token_ids_of

    tokenizer = get_tokenizer(model_config.tokenizer, revision=model_config.tokenizer_revision,
                              tokenizer_mode=model_config.tokenizer_mode,
                              trust_remote_code=model_config.trust_remote_code)
    tied = bool(loaded.hf_config.get("tie_word_embeddings", False))
    return score_weight_from_tokens(model_config.model, method, token_ids_of(tokenizer, tokens), tied)


def check_attention_head_size(model: str, head_dim: int) -> None:
    """Refuses, at load, a head size the attention kernels of this path lack (else the
    first forward, in warm-up, would fail without naming the model)."""
    gpu = model_runs_on_gpu()
    metal = gpu or _core.kernel_backend() == "emulated"
    problem = _core.paged_attention_head_size_problem(head_dim, metal=metal)
    if problem:
        path = "the Metal GPU path" if gpu else "the emulated Metal kernels" if metal else "the CPU path"
        raise ValueError(f"[vllm-metal] {model}: attention head size {head_dim} is not supported on "
                         f"{path} ({problem})")


def _dtype_name(dtype) -> str | None:
    name = str(dtype).replace("torch.", "")
    return name if name in _TORCH_DTYPES else None
