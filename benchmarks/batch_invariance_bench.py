"""What batch-invariant mode (VLLM_BATCH_INVARIANT) costs per kernel, on the CPU, side by side.

For each case the same inputs run with the mode off and on, interleaved (off, on, off, on, ...),
and the medians are compared: ratio = on / off (1.0: free). Cases:
  matmuls   SmolLM2-135M's 211 GGUF matmuls of one forward (the real Q4_1 file, Q8_0 head) at
            m rows: 1 (single-stream decode), 16 and 64 (batched decode), 160 (a prefill chunk
            beside decodes), float32 sums (the default) and int8 activations.
  attention SmolLM2's attention shape (9 q / 3 kv heads, d 64) of 16 decode rows at 512
            keys, and a 128-token prefill chunk after 384 cached tokens.

    .venv/bin/python benchmarks/batch_invariance_bench.py [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_bench import load_smollm2  # noqa: E402

from vllm_metal import _core, ops  # noqa: E402


def interleaved(fn, repeats: int) -> tuple[float, float]:
    """Median seconds of fn() with the mode off and on, measured alternately."""
    times = {False: [], True: []}
    for on in (False, True):  # warm-up both
        ops.set_batch_invariant(on)
        fn()
    for _ in range(repeats):
        for on in (False, True):
            ops.set_batch_invariant(on)
            t0 = time.perf_counter()
            fn()
            times[on].append(time.perf_counter() - t0)
    ops.set_batch_invariant(False)
    return statistics.median(times[False]), statistics.median(times[True])


def matmul_case(layers, head, m: int, exact: bool):
    x = mx.array(np.random.default_rng(m).standard_normal((m, 576)).astype(np.float32))
    x2 = mx.array(np.random.default_rng(m + 1).standard_normal((m, 1536)).astype(np.float32))
    mx.eval(x, x2)

    def run():
        outs = []
        for layer in layers:
            for name, w in layer.items():
                blocks, t, shape = w
                outs.append(_core.gguf_matmul(x2 if name == "ffn_down" else x, blocks, t, shape,
                                              exact=exact))
        blocks, t, shape = head
        outs.append(_core.gguf_matmul(x, blocks, t, shape, exact=exact))
        mx.eval(outs)
    return run


def attention_case(q_lens, ctx_lens):
    rng = np.random.default_rng(0)
    hq, hkv, d, bs = 9, 3, 64, 16
    blocks = [math.ceil(c / bs) for c in ctx_lens]
    tables = np.arange(sum(blocks), dtype=np.int32)
    table = np.zeros((len(q_lens), max(blocks)), np.int32)
    at = 0
    for s, n in enumerate(blocks):
        table[s, :n] = tables[at:at + n]
        at += n
    f16 = lambda shape: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.float16)  # noqa: E731
    q = f16((sum(q_lens), hq, d))
    kc, vc = f16((sum(blocks), bs, hkv, d)), f16((sum(blocks), bs, hkv, d))
    args = (mx.array(table), mx.array(np.array(ctx_lens, np.int32)),
            mx.array(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)))
    mx.eval(q, kc, vc, *args)

    def run():
        outs = [ops.paged_attention(q, kc, vc, *args, scale=0.125) for _ in range(30)]  # 30 layers
        mx.eval(outs)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    layers, head = load_smollm2()
    cases = []
    for exact in (True, False):
        for m in (1, 16, 64, 160):
            cases.append((f"matmuls m={m} {'float32 sums' if exact else 'int8 activations'}",
                          matmul_case(layers, head, m, exact)))
    cases.append(("attention 16 decode rows x 512 keys", attention_case([1] * 16, [512] * 16)))
    cases.append(("attention prefill 128 after 384 cached", attention_case([128], [512])))
    records = []
    print(f"# {platform.processor() or platform.machine()}, {_core.num_threads()} threads, "
          f"median of {args.repeats}")
    print("| case | off ms | on ms | on / off |\n|---|---|---|---|")
    for name, fn in cases:
        off, on = interleaved(fn, args.repeats)
        rec = {"case": name, "off_ms": off * 1e3, "on_ms": on * 1e3, "ratio": on / off}
        records.append(rec)
        print(f"| {name} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.2f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
