"""A bounded cache of MoE experts read from the checkpoint file on demand.

Experts of every layer whose expert tensors have the same shape and type share one
`ExpertPool`: fixed MLX arrays [slots, ...] for gate / up / down, an LRU over
(layer, expert) -> slot across the whole model. A miss is read with os.pread (no
mmap: the process's RSS stays the cache plus what is being read) and written into
its slot in place (MLX donates the pool's buffer to the update: no copy of the pool).

`StreamedExperts.run` is one MoE layer's routed MLP: the router's top-k ids are
evaluated on the host, the misses loaded, and ops.fused_moe / fused_moe_gguf run on
the pool with the routing re-expressed per slot: each token's chosen experts get
z = logit(p) under sigmoid scoring (sigmoid(z) = p, whatever scoring and
normalisation the model uses), every other slot -inf, so the op's own top-k picks
exactly the token's experts with their weights. When one layer's batch needs more
experts than the pool has slots (a long prefill), the layer runs in rounds of
at most `slots` experts and the rounds' outputs add up.

Prefetch: after a layer's ids are known, the experts the next MoE layer is likely to
pick are read on a background thread (bytes only; the main thread installs them) while
this layer computes (at most 2 top-k experts' bytes in flight). The guess ("router", default) is the next layer's router applied
to this layer's input (the residual stream changes little from one layer to the next);
"last" takes the ids the next layer picked in the previous step.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

_NEG = -1e30  # a slot a token must not pick: below any clipped z
_Z_CLIP = 88.0  # sigmoid(88) == 1.0 in float32; keeps p = 1 (top-1 renormalised) finite


@dataclass(frozen=True)
class ExpertBytes:
    """Where one projection of one expert lies in a file, and how to read it."""
    path: str
    offset: int  # absolute byte offset in the file
    nbytes: int
    file_dtype: str  # "F32" / "F16" / "BF16" for dense; "blocks" for GGUF bytes


@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    bytes_streamed: int = 0
    prefetched: int = 0  # misses whose bytes a prefetch had already read
    prefetch_wasted: int = 0  # experts a prefetch read that the layer did not need

    def as_dict(self) -> dict:
        return dict(hits=self.hits, misses=self.misses, bytes_streamed=self.bytes_streamed,
                    prefetched=self.prefetched, prefetch_wasted=self.prefetch_wasted)


_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "blocks": np.uint8}


class FileReader:
    """pread of byte ranges, one descriptor per file, safe across threads."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def read(self, where: ExpertBytes) -> bytearray:
        with self._lock:
            fd = self._fds.get(where.path)
            if fd is None:
                fd = self._fds[where.path] = os.open(where.path, os.O_RDONLY)
        buf = bytearray(where.nbytes)
        view, done = memoryview(buf), 0
        while done < where.nbytes:
            n = os.preadv(fd, [view[done:]], where.offset + done)
            if n <= 0:
                raise OSError(f"[vllm-metal] short read of {where.path} at {where.offset + done}")
            done += n
        return buf

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass
class ProjSpec:
    """One projection's slot layout in a pool: the MLX dtype and the per-expert shape."""
    shape: tuple  # per expert: (rows, cols) dense, (nbytes,) GGUF blocks
    dtype: mx.Dtype


@dataclass
class ExpertPool:
    """Slots for the experts of every layer with one signature (shape, dtype, GGUF type)."""
    slots: int
    projs: tuple  # 3 ProjSpec: gate, up, down
    arrays: list = field(default_factory=list)  # 3 mx.array [slots, *shape]
    lru: OrderedDict = field(default_factory=OrderedDict)  # (layer, expert) -> slot; oldest first
    owner: list = field(default_factory=list)  # slot -> (layer, expert) or None
    policy: str = "lru"  # "lru", or "fifo" (a hit does not refresh), for comparison

    def __post_init__(self):
        self.arrays = [mx.zeros((self.slots, *p.shape), dtype=p.dtype) for p in self.projs]
        mx.eval(self.arrays)
        self.owner = [None] * self.slots

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def touch(self, key) -> int | None:
        slot = self.lru.get(key)
        if slot is not None and self.policy == "lru":
            self.lru.move_to_end(key)
        return slot

    def claim(self, key, pinned: set) -> int:
        """A slot for `key`: a free one, else the least recently used not in `pinned`."""
        if len(self.lru) < self.slots:
            slot = self.owner.index(None)
        else:
            victim = next(k for k in self.lru if k not in pinned)
            slot = self.lru.pop(victim)
        self.lru[key] = slot
        self.owner[slot] = key
        return slot

    def write(self, slot: int, values: list):
        for i, v in enumerate(values):
            self.arrays[i][slot] = v


def _to_mx(buf: bytearray, where: ExpertBytes, spec: ProjSpec) -> mx.array:
    raw = np.frombuffer(buf, dtype=_NP_DTYPES[where.file_dtype])
    a = mx.array(raw)
    if where.file_dtype == "BF16":
        a = a.view(mx.bfloat16)
    return a.reshape(spec.shape).astype(spec.dtype)


class ExpertCache:
    """The pools, the reader, the stats and the prefetcher of one model."""

    def __init__(self, pools: list, *, prefetch: bool = False, guess: str = "router"):
        self.pools = pools
        self.guess = guess
        self.reader = FileReader()
        self.stats = ExpertStats()
        self.prefetch_enabled = prefetch
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="expert-prefetch") if prefetch else None
        self._prefetched: dict = {}  # (layer, expert) -> Future of [3 bytearray]
        self.layers: list = []  # StreamedExperts in model order (for prefetch)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.pools)

    def prefetch(self, layer: "StreamedExperts", x: mx.array, top_k: int):
        """Start reading (on the background thread) the experts the next layer will likely pick."""
        if self._executor is None or layer.next is None:
            return
        nxt = layer.next
        if self.guess == "router" and nxt.gate is not None:
            logits = nxt.gate(x).astype(mx.float32)
            picked = np.array(mx.argpartition(-logits, kth=top_k - 1, axis=-1)[:, :top_k])
            ids, counts = np.unique(picked, return_counts=True)
            guess = ids[np.argsort(-counts, kind="stable")].tolist()  # most picked first
        else:
            guess = list(nxt.last_ids)
        # at most 2 top-k experts in flight: a prefill's guess is most of the layer, whose
        # bytes would sit in memory beside the cache
        for e in guess[:2 * top_k]:
            key = (nxt.layer, e)
            if key in nxt.pool.lru or key in self._prefetched:
                continue
            self._prefetched[key] = self._executor.submit(
                lambda w=nxt.where[e]: [self.reader.read(x) for x in w])

    def take_prefetched(self, key):
        fut: Future | None = self._prefetched.pop(key, None)
        return None if fut is None else fut.result()

    def drop_stale_prefetches(self, layer: int):
        for key in [k for k in self._prefetched if k[0] == layer]:
            self._prefetched.pop(key).result()
            self.stats.prefetch_wasted += 1

    def close(self):
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.reader.close()


def routing_weights(logits: mx.array, top_k: int, scoring: str, renormalize: bool):
    """-> (ids [T, k] int32, p [T, k] float32): each token's experts and their routing
    weights, as the fused op computes them (top-k of the logits; on an exact tie of two
    logits the pick may differ from the op's lower-id rule)."""
    logits = logits.astype(mx.float32)
    ids = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[:, :top_k]
    if scoring == "softmax":
        p = mx.take_along_axis(mx.softmax(logits, axis=-1), ids, axis=-1)
    elif scoring == "softmax_topk":  # gpt-oss: softmax over the chosen logits only
        p = mx.softmax(mx.take_along_axis(logits, ids, axis=-1), axis=-1)
    else:
        p = mx.sigmoid(mx.take_along_axis(logits, ids, axis=-1))
    if renormalize:
        p = p / mx.sum(p, axis=-1, keepdims=True)
    return ids.astype(mx.int32), p


def routing_z(logits: mx.array, top_k: int, scoring: str, renormalize: bool):
    """-> (ids [T, k] int32, z [T, k] float32): routing_weights with z = logit(p)."""
    ids, p = routing_weights(logits, top_k, scoring, renormalize)
    return ids, mx.clip(mx.log(p) - mx.log1p(-p), -_Z_CLIP, _Z_CLIP)


class StreamedExperts:
    """One MoE layer's experts, on disk: `where[e]` = 3 ExpertBytes (gate, up, down)."""

    def __init__(self, cache: ExpertCache, pool: ExpertPool, layer: int, where: list,
                 num_experts: int, gguf_types: tuple | None = None, inter: int = 0,
                 convert=None):
        self.cache = cache
        self.pool = pool
        self.layer = layer
        self.where = where
        self.num_experts = num_experts
        self.gguf_types = gguf_types  # (gate, up, down) GGML type ids, None: dense
        self.inter = inter
        self.exact = True  # GGUF activations (gguf_linear.set_exact_activations)
        self.last_ids: list = []  # the experts this layer used last step (prefetch guess)
        self.next: StreamedExperts | None = None
        self.gate = None  # this layer's router (the previous layer's prefetch guess)
        # `where[e]` read in another layout (gpt-oss's fused gate_up, MXFP4 blocks + scales):
        # convert(bufs) -> the 3 slot arrays (gate, up, down); None: where[e] is those 3
        self.convert = convert
        self.biases = None  # (gate [E, I], up [E, I], down [E, H]) resident (gpt-oss), or None
        self.activation = "silu"

    def _load(self, experts: list, pinned: set) -> None:
        pool, cache = self.pool, self.cache
        for e in experts:
            key = (self.layer, e)
            if pool.touch(key) is not None:
                cache.stats.hits += 1
                continue
            bufs = cache.take_prefetched(key)
            if bufs is not None:
                cache.stats.prefetched += 1
            else:
                bufs = [cache.reader.read(w) for w in self.where[e]]
            cache.stats.misses += 1
            cache.stats.bytes_streamed += sum(len(b) for b in bufs)
            slot = pool.claim(key, pinned)
            if self.convert is not None:
                pool.write(slot, [v.astype(s.dtype) for v, s in zip(self.convert(bufs), pool.projs)])
            else:
                pool.write(slot, [_to_mx(b, w, s) for b, w, s in zip(bufs, self.where[e], pool.projs)])
            mx.eval(pool.arrays)  # one expert's staging copy alive at a time

    def run(self, x: mx.array, logits: mx.array, *, top_k: int, scoring: str,
            renormalize: bool) -> mx.array:
        ids, z = routing_z(logits, top_k, scoring, renormalize)
        mx.eval(ids, z)
        ids_np = np.array(ids)
        needed = sorted(set(ids_np.reshape(-1).tolist()))
        self.cache.prefetch(self, x, top_k)
        pool = self.pool
        # resident experts first, so a round needing no reads comes first
        needed.sort(key=lambda e: (self.layer, e) not in pool.lru)
        out = None
        for start in range(0, len(needed), pool.slots):
            chunk = needed[start:start + pool.slots]
            self._load(chunk, {(self.layer, e) for e in chunk})
            y = self._run_round(x, ids_np, z, chunk, top_k)
            out = y if out is None else out + y
            if start + pool.slots < len(needed):
                mx.eval(out)  # the next round rewrites slots this one reads
        self.cache.drop_stale_prefetches(self.layer)
        self.last_ids = needed
        return out

    def _run_round(self, x, ids_np: np.ndarray, z: mx.array, chunk: list, top_k: int):
        from vllm_metal import ops

        pool = self.pool
        slot_of = np.full(self.num_experts, -1, dtype=np.int64)
        for e in chunk:
            slot_of[e] = pool.lru[(self.layer, e)]
        slots = slot_of[ids_np]  # [T, k]; -1: the expert is in another round
        t = ids_np.shape[0]
        rows = np.repeat(np.arange(t), top_k)[(slots >= 0).reshape(-1)]
        flat = (rows * pool.slots + slots[slots >= 0]).astype(np.int32)
        zs = z.reshape(-1)[mx.array(np.flatnonzero((slots >= 0).reshape(-1)).astype(np.int32))]
        slot_logits = mx.full((t * pool.slots,), _NEG, dtype=mx.float32)
        slot_logits[mx.array(flat)] = zs
        slot_logits = slot_logits.reshape(t, pool.slots)
        k = min(top_k, pool.slots)
        g, u, d = pool.arrays
        kw = dict(top_k=k, renormalize=False, scoring="sigmoid", activation=self.activation)
        if self.biases is not None:  # each slot's expert's biases (any expert for a foreign slot)
            owner = mx.array([o[1] if o is not None and o[0] == self.layer else 0
                              for o in pool.owner], dtype=mx.int32)
            kw.update(b_gate=self.biases[0][owner], b_up=self.biases[1][owner],
                      b_down=self.biases[2][owner])
        if self.gguf_types is None:
            return ops.fused_moe(x, slot_logits, g, u, d, **kw)
        tg, tu, td = self.gguf_types
        return ops.fused_moe_gguf(x, slot_logits, g, tg, u, tu, d, td, inter=self.inter,
                                  exact=self.exact, **kw)
