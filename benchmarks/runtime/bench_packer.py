"""BatchPacker (C++) against the equivalent NumPy code, per scheduler step, side by side.

Workload at N = 1, 8, 64, 256, 512 running requests: N // 8 prefill chunks
(prompts of 4,096 tokens, chunks sharing an 8,192-token budget, at most 512
tokens each) and the rest decodes (contexts 128..2,048), block size 16,
max_model_len 8,192. Each step the scheduler's deltas advance every request
(num_computed_tokens, a new block id whenever a request crosses a block
boundary), the step is packed, and one sampled token per finished row is
appended. Both sides compute the same arrays (checked every step, untimed):

    numpy: vLLM-V1-style persistent CPU state (token table [reqs, max_model_len],
           block table [reqs, max_blocks], a req_id -> row dict), updated with
           a Python loop over the cached requests, packed with vectorised NumPy
           (np.repeat / fancy indexing, block-table rows gathered per step),
           sampled tokens written with a Python loop
    ours:  vllm_metal._core.BatchPacker: update_requests + pack(dict) +
           append_sampled, the calls scheduler_delta.SchedulerDelta makes

Reported (median per step, microseconds): `pack` (dict of scheduled tokens ->
every array) and `step` (deltas + pack + sampled tokens), with ratio =
numpy / ours (> 1: ours is faster); `rows` is ours packing the same step again
from int32 row arrays (pack_rows: the C++ cost without reading Python dicts and
strings, caches warm); `mlx copy` is scheduler_delta.mlx_inputs (the step's
arrays as mx.array copies). The two sides run one after the other each step,
so each starts with caches the other has churned through, as a runner's
packing starts after a forward pass. The JSON also has each minimum (`*_min_us`).

    .venv/bin/python benchmarks/runtime/bench_packer.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

import mlx.core as mx  # noqa: F401  (MLX's types load before the extension)
from vllm_metal import _core

BLOCK = 16
MAX_MODEL_LEN = 8192
MAX_TOKENS = 8192
MAX_REQS = 512
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK
PROMPT_LEN = 4096
DECODE_THRESHOLD = 512


# ---- the NumPy equivalent ---------------------------------------------------------


class NumpyPacker:
    """The same request table and packing, the way vLLM's V1 runner does it in NumPy."""

    def __init__(self):
        self.token_ids = np.zeros((MAX_REQS, MAX_MODEL_LEN), np.int32)  # row -> tokens
        self.num_tokens = np.zeros(MAX_REQS, np.int32)
        self.num_computed = np.zeros(MAX_REQS, np.int32)
        self.block_table = np.zeros((MAX_REQS, MAX_BLOCKS), np.int32)
        self.num_blocks = np.zeros(MAX_REQS, np.int32)
        self.index: dict[str, int] = {}  # req_id -> row
        self.free = list(range(MAX_REQS - 1, -1, -1))
        self.batch_rows = None

    def add(self, rid, tokens, computed, blocks):
        row = self.free.pop()
        self.index[rid] = row
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed[row] = computed
        self.block_table[row, : len(blocks)] = blocks
        self.num_blocks[row] = len(blocks)

    def update(self, req_ids, num_computed, new_block_ids):
        for rid, c, new in zip(req_ids, num_computed, new_block_ids):
            row = self.index[rid]
            self.num_computed[row] = c
            if new is not None:
                ids = new[0]
                n = self.num_blocks[row]
                self.block_table[row, n : n + len(ids)] = ids
                self.num_blocks[row] = n + len(ids)

    def pack(self, num_scheduled: dict):
        ids = list(num_scheduled)
        rows = np.fromiter(map(self.index.__getitem__, ids), np.int64, len(ids))
        q = np.fromiter(num_scheduled.values(), np.int32, len(ids))
        is_decode = q == 1
        order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])
        rows, q = rows[order], q[order]
        n = len(rows)
        cu = np.zeros(n + 1, np.int32)
        np.cumsum(q, out=cu[1:])
        T = int(cu[-1])
        tok_req = np.repeat(np.arange(n), q)
        c = self.num_computed[rows]
        positions = (c[tok_req] + (np.arange(T, dtype=np.int32) - cu[:-1][tok_req])).astype(np.int32)
        tok_rows = rows[tok_req]
        input_ids = self.token_ids[tok_rows, positions]
        slot_mapping = self.block_table[tok_rows, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
        seq_lens = (c + q).astype(np.int32)
        need = -(-seq_lens // BLOCK)
        block_tables = self.block_table[rows]
        block_tables[np.arange(MAX_BLOCKS) >= need[:, None]] = 0
        logits_indices = cu[1:] - 1
        num_decode_like = int(is_decode.sum())
        num_decodes = num_decode_like if seq_lens[:num_decode_like].sum() >= DECODE_THRESHOLD else 0
        discard = c + q < self.num_tokens[rows]
        self.batch_rows, self.discard = rows, discard
        return dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, seq_lens=seq_lens,
                    cu_seqlens_q=cu, logits_indices=logits_indices, block_table=block_tables,
                    discard_sampled=discard, num_decodes=num_decodes)

    def append_sampled(self, sampled):
        for row, skip, tok in zip(self.batch_rows.tolist(), self.discard.tolist(), sampled[:, 0].tolist()):
            if not skip:
                self.token_ids[row, self.num_tokens[row]] = tok
                self.num_tokens[row] += 1


# ---- the workload ------------------------------------------------------------------


class Workload:
    """N running requests; step() yields the scheduler's deltas for one step."""

    def __init__(self, n, seed):
        self.rng = np.random.default_rng(seed)
        self.n = n
        self.num_prefill = n // 8
        self.next_block = 1
        self.reqs = {}  # id -> [tokens, computed, num_blocks, is_prefill]
        for i in range(n):
            rid = f"cmpl-{self.rng.integers(1 << 62):016x}{i:016x}-0"
            if i < self.num_prefill:
                tokens = self.rng.integers(0, 50000, PROMPT_LEN).tolist()
                computed = 0
            else:
                ctx = int(self.rng.integers(128, 2049))
                tokens = self.rng.integers(0, 50000, ctx).tolist()
                computed = ctx - 1
            blocks = self._blocks(-(-max(computed, 1) // BLOCK))
            self.reqs[rid] = [tokens, computed, blocks, i < self.num_prefill]
        decode_tokens = n - self.num_prefill
        self.chunk = min(512, (MAX_TOKENS - decode_tokens) // self.num_prefill) if self.num_prefill else 0

    def _blocks(self, k):
        ids = list(range(self.next_block, self.next_block + k))
        self.next_block += k
        return ids

    def schedule(self):
        """This step's deltas: (cached req ids, num_computed, new block ids, num_scheduled)."""
        ids, computed, new_blocks, sched = [], [], [], {}
        for rid, r in self.reqs.items():
            tokens, c, blocks, prefill = r
            q = min(self.chunk, len(tokens) - c) if prefill else 1
            need = -(-(c + q) // BLOCK)
            add = self._blocks(need - len(blocks)) if need > len(blocks) else None
            if add:
                blocks.extend(add)
            ids.append(rid)
            computed.append(c)
            new_blocks.append((add,) if add else None)
            sched[rid] = q
        return ids, computed, new_blocks, sched

    def advance(self, sched, sampled_by_id):
        """Applies the step; returns the prefill requests that start a fresh prompt."""
        restarted = []
        for rid, q in sched.items():
            r = self.reqs[rid]
            r[1] += q
            if r[1] == len(r[0]):
                r[0].append(sampled_by_id[rid])
            if r[3] and r[1] >= len(r[0]) - 1:  # prompt done: a fresh one keeps the mix
                r[0] = self.rng.integers(0, 50000, PROMPT_LEN).tolist()
                r[1] = 0
                r[2] = self._blocks(1)
                restarted.append(rid)
        return restarted


# ---- measuring ------------------------------------------------------------------------


def build(n, seed):
    w = Workload(n, seed)
    ours = _core.BatchPacker(max_num_reqs=MAX_REQS, max_num_batched_tokens=MAX_TOKENS,
                             max_model_len=MAX_MODEL_LEN, kv_groups=[_core.KvGroupSpec(BLOCK)])
    ref = NumpyPacker()
    for rid, (tokens, c, blocks, _) in w.reqs.items():
        ours.add_request(rid, tokens, num_computed_tokens=c, block_ids=(blocks,))
        ref.add(rid, tokens, c, blocks)
    return w, ours, ref


def check(ours, got):
    assert got["num_decodes"] == ours.num_decodes
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "cu_seqlens_q", "logits_indices",
                 "discard_sampled"):
        np.testing.assert_array_equal(getattr(ours, name), got[name], err_msg=name)
    np.testing.assert_array_equal(ours.block_table, got["block_table"], err_msg="block_table")


def run(n, steps, reps, seed=0):
    from vllm_metal.scheduler_delta import mlx_inputs

    t = {k: [] for k in ("numpy_pack", "numpy_step", "ours_pack", "ours_step", "ours_rows", "mlx_copy")}
    tokens = 0
    for rep in range(reps):
        w, ours, ref = build(n, seed + rep)
        for _ in range(steps):
            ids, computed, new_blocks, sched = w.schedule()
            sampled = w.rng.integers(0, 50000, (len(sched), 1)).astype(np.int32)

            t0 = time.perf_counter_ns()
            ref.update(ids, computed, new_blocks)
            t1 = time.perf_counter_ns()
            got = ref.pack(sched)
            t2 = time.perf_counter_ns()
            ref.append_sampled(sampled)
            t3 = time.perf_counter_ns()
            t["numpy_pack"].append(t2 - t1)
            t["numpy_step"].append(t3 - t0)

            t0 = time.perf_counter_ns()
            ours.update_requests(ids, computed, new_blocks)
            t1 = time.perf_counter_ns()
            ours.pack(sched)
            t2 = time.perf_counter_ns()
            ours.append_sampled(sampled)
            t3 = time.perf_counter_ns()
            t["ours_pack"].append(t2 - t1)
            t["ours_step"].append(t3 - t0)
            tokens = ours.num_tokens
            check(ours, got)  # untimed; batch order is the same on both sides

            t0 = time.perf_counter_ns()
            mlx_inputs(ours)
            t1 = time.perf_counter_ns()
            rows, q = np.array(ours.req_rows), np.diff(ours.cu_seqlens_q)
            t2 = time.perf_counter_ns()
            ours.pack_rows(rows, q)  # the same step again, from int32 rows
            t3 = time.perf_counter_ns()
            t["mlx_copy"].append(t1 - t0)
            t["ours_rows"].append(t3 - t2)

            by_id = dict(zip(ours.req_ids, sampled[:, 0].tolist()))
            for rid in w.advance(sched, by_id):  # untimed: both sides re-add the request
                tokens_, c, blocks, _ = w.reqs[rid]
                ours.add_request(rid, tokens_, num_computed_tokens=c, block_ids=(blocks,), replace=True)
                ref.free.append(ref.index.pop(rid))
                ref.add(rid, tokens_, c, blocks)
    med = {k: statistics.median(v) / 1e3 for k, v in t.items()}
    best = {f"{k}_min_us": min(v) / 1e3 for k, v in t.items()}  # least disturbed by load
    return dict(
        running=n, prefill_chunks=n // 8, tokens=tokens,
        numpy_pack_us=med["numpy_pack"], ours_pack_us=med["ours_pack"],
        pack_ratio=med["numpy_pack"] / med["ours_pack"],
        numpy_step_us=med["numpy_step"], ours_step_us=med["ours_step"],
        step_ratio=med["numpy_step"] / med["ours_step"],
        ours_rows_us=med["ours_rows"],
        mlx_copy_us=med["mlx_copy"],
        **best,
    )


def machine():
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return dict(cpu=model, cores=os.cpu_count(), python=platform.python_version(), numpy=np.__version__,
                load=os.getloadavg() if hasattr(os, "getloadavg") else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    ap.add_argument("--json", help="also write the run as one JSON document")
    args = ap.parse_args()
    steps, reps = (6, 3) if args.quick else (12, 9)
    info = machine()
    print(f"# {info['cpu']} ({info['cores']} cores), Python {info['python']}, NumPy {info['numpy']}, "
          f"load {info['load']}")
    print(f"# median per step of {steps} steps x {reps} workloads; microseconds; ratio = numpy / ours")
    hdr = f"{'running':>7} {'chunks':>6} {'tokens':>6} | {'pack numpy':>10} {'ours':>8} {'ratio':>6} | " \
          f"{'step numpy':>10} {'ours':>8} {'ratio':>6} | {'rows':>7} {'mlx copy':>8}"
    print(hdr)
    results = []
    for n in (1, 8, 64, 256, 512):
        r = run(n, steps, reps)
        results.append(r)
        print(f"{r['running']:>7} {r['prefill_chunks']:>6} {r['tokens']:>6} | {r['numpy_pack_us']:>10.1f} "
              f"{r['ours_pack_us']:>8.1f} {r['pack_ratio']:>6.1f} | {r['numpy_step_us']:>10.1f} "
              f"{r['ours_step_us']:>8.1f} {r['step_ratio']:>6.1f} | {r['ours_rows_us']:>7.1f} "
              f"{r['mlx_copy_us']:>8.1f}", flush=True)
    info["load_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print("# JSON")
    for r in results:
        print(json.dumps({"bench": "packer", **r}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "steps": steps, "reps": reps, "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
