"""What serving LoRA adapters costs: decode throughput at concurrency 16 with 0, 1 and 4
distinct adapters in the batch, against the base model served without --enable-lora.

Ours on SmolLM2-135M Q4_1 GGUF (the weights stay in block form), in one run: first the
plain server, then one with `--enable-lora --max-loras 4 --max-lora-rank R` and four
random PEFT adapters of rank R on every q/k/v/o/gate/up/down projection. Each cell sends
the same 16 requests at once (short prompts, --output-len tokens, greedy, ignore_eos) and
reports output tokens / wall time, the median of --reps runs. Cells: "base" (plain
server), "lora, 0 adapters" (LoRA server, every request on the base model), "1 adapter"
(all 16 on one), "4 adapters" (4 requests each).

    .venv/bin/python benchmarks/lora_overhead.py [--rank 8] [--output-len 64] [--reps 3]
        [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "compare"))
sys.path.insert(0, str(ROOT / "tests" / "py"))
import servers  # noqa: E402
from lora_checkpoint import write_adapter  # noqa: E402

CONCURRENCY = 16


def projection_shapes(gguf: str) -> tuple[dict, int]:
    """Constant stand-ins of every projection weight (write_adapter reads only their
    shapes and mean magnitude), and the number of layers."""
    from vllm_metal.models import prepare_gguf_dir

    cfg = json.loads((Path(prepare_gguf_dir(gguf)) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    n = cfg["num_hidden_layers"]
    weights = {f"model.layers.{i}.{k}.weight": np.full(s, 0.02, np.float32)
               for i in range(n) for k, s in shapes.items()}
    return weights, n


def cell(base: str, models: list[str], output_len: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, 40000, 16).tolist() for _ in models]

    def one(args):
        model, prompt = args
        r = httpx.post(base + "/v1/completions", timeout=600, json={
            "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        tokens = sum(pool.map(one, zip(models, prompts)))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    from vllm_metal.models.offline import smollm2_gguf

    gguf = str(smollm2_gguf())
    weights, n = projection_shapes(gguf)
    tmp = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    names = [f"a{i}" for i in range(4)]
    for i, name in enumerate(names):
        write_adapter(tmp / name, weights, n, r=args.rank, alpha=2 * args.rank, seed=i)
    plans = {"base": None,
             "lora, 0 adapters": ["m"] * CONCURRENCY,
             "lora, 1 adapter": ["a0"] * CONCURRENCY,
             "lora, 4 adapters": [names[i % 4] for i in range(CONCURRENCY)]}
    results = {}
    for lora in (False, True):
        port = 8670 + int(lora)  # this session's port range
        peer = servers.ours(gguf, port, args.threads, CONCURRENCY, int8_activations=False)
        if lora:
            peer.argv += ["--enable-lora", "--max-loras", "4", "--max-lora-rank", str(args.rank),
                          "--lora-modules", *[f"{a}={tmp / a}" for a in names]]
        server = servers.RunningServer(peer, port)
        try:
            base = f"http://127.0.0.1:{port}"
            cell(base, ["m"] * 2, 8, seed=99)  # warm-up
            for label, models in plans.items():
                if (models is None) == lora:
                    continue
                runs = [cell(base, models or ["m"] * CONCURRENCY, args.output_len, seed=r)
                        for r in range(args.reps)]
                results[label] = statistics.median(runs)
                print(f"{label:>18}: {results[label]:7.1f} tok/s  (runs {', '.join(f'{x:.1f}' for x in runs)})",
                      flush=True)
        finally:
            server.stop()
    ref = results["base"]
    print(f"\n| cell | out tok/s at {CONCURRENCY} | vs base |\n|---|---:|---:|")
    for label, v in results.items():
        print(f"| {label} | {v:.1f} | {v / ref:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rank": args.rank, "output_len": args.output_len,
                                               "tok_s": results}, indent=2))


if __name__ == "__main__":
    main()
