"""What serving LoRA adapters costs: decode throughput at concurrency 16 with 0, 1 and 4
distinct adapters in the batch, against the base model served without --enable-lora.

Ours on SmolLM2-135M Q4_1 GGUF (the weights stay in block form), in one run: the plain
server and one with `--enable-lora --max-loras 4 --max-lora-rank R` and four random PEFT
adapters of rank R on every q/k/v/o/gate/up/down projection (with --before-venv, a third:
the same LoRA server from another checkout's venv), all up at once, the cells taking turns
rep by rep. Each cell sends the same 16 requests at once (short prompts, --output-len
tokens, greedy, ignore_eos) and reports output tokens / wall time, the median of --reps
runs. Cells: "base" (plain server), "lora, 0 adapters" (LoRA server, every request on the
base model), "1 adapter" (all 16 on one), "4 adapters" (4 requests each).

    .venv/bin/python benchmarks/lora_overhead.py [--rank 8] [--output-len 64] [--reps 3]
        [--threads 2] [--port 18900] [--before-venv /work/main/.venv] [--json PATH]
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
    ap.add_argument("--port", type=int, default=18900, help="this and the next two ports")
    ap.add_argument("--before-venv", help="also a LoRA server from this venv (another "
                    "checkout's build: the code before a change), measured in the same run")
    ap.add_argument("--json")
    args = ap.parse_args()
    from vllm_metal.models.offline import smollm2_gguf

    gguf = str(smollm2_gguf())
    weights, n = projection_shapes(gguf)
    tmp = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    names = [f"a{i}" for i in range(4)]
    for i, name in enumerate(names):
        write_adapter(tmp / name, weights, n, r=args.rank, alpha=2 * args.rank, seed=i)
    lora_plans = {"0 adapters": ["m"] * CONCURRENCY,
                  "1 adapter": ["a0"] * CONCURRENCY,
                  "4 adapters": [names[i % 4] for i in range(CONCURRENCY)]}
    lora_args = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", str(args.rank),
                 "--lora-modules", *[f"{a}={tmp / a}" for a in names]]
    # every server runs at once and the cells take turns, rep by rep: the other load on
    # a shared machine moves every cell alike
    kinds = [("base", None), ("lora", sys.executable)]
    if args.before_venv:
        kinds.append(("lora before", str(Path(args.before_venv) / "bin" / "python")))
    servers_up, cells = {}, {}
    try:
        for i, (kind, python) in enumerate(kinds):
            port = args.port + i
            peer = servers.ours(gguf, port, args.threads, CONCURRENCY, int8_activations=False)
            if python is not None:
                peer.argv[0] = str(Path(python).with_name("vllm"))
                peer.argv += lora_args
            servers_up[kind] = server = servers.RunningServer(peer, port)
            cell(server.base, ["m"] * 2, 8, seed=99)  # warm-up
            if python is None:
                cells["base"] = (server.base, ["m"] * CONCURRENCY)
            else:
                for label, models in lora_plans.items():
                    cells[f"{kind}, {label}"] = (server.base, models)
        runs = {label: [] for label in cells}
        for r in range(args.reps):
            for label, (base, models) in cells.items():
                runs[label].append(cell(base, models, args.output_len, seed=r))
                print(f"rep {r} {label:>24}: {runs[label][-1]:7.1f} tok/s", flush=True)
    finally:
        for server in servers_up.values():
            server.stop()
    results = {label: statistics.median(v) for label, v in runs.items()}
    ref = results["base"]
    print(f"\n| cell | out tok/s at {CONCURRENCY} (median of {args.reps}) | vs base |\n|---|---:|---:|")
    for label, v in results.items():
        print(f"| {label} | {v:.1f} | {v / ref:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rank": args.rank, "output_len": args.output_len,
                                               "tok_s": results, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
