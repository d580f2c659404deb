"""`vllm serve` on the path a Mac runs: every op on its Metal kernel (here in the emulator,
VLLM_METAL_KERNELS=emulated): each layer one decoder_layer op whose Metal plan runs fused
kernels for steps of up to 8 tokens and the per-op kernels for longer ones, under async
scheduling (vLLM's default: step N+1 is built and submitted
while step N computes). Tiny random-weight checkpoints (2 layers, head size 64) of llama,
gemma3 and qwen3.5 keep the emulator fast.

Concurrent requests of different lengths (decodes sharing steps with chunked prefills) must
get the greedy tokens of the CPU path (native kernels, fused layers where they apply), each
computed alone in this process, and their logprobs within 2e-3: a kernel that sums batched
rows in another order than solo ones shows up here as soon as it flips a token, a wrong
kernel well before that.

A fourth server, llama with VLLM_BATCH_INVARIANT=1, must give each request bitwise the
logprobs it gets alone on the same server: the default plans' batched-vs-solo differences
(~1e-6, Metal mat-mat vs mat-vec, prefill vs decode attention) are below the CPU comparison's
tolerance, so this is where a planner that lets the batch choose a row's sums shows.

A hook in the server (sitecustomize on PYTHONPATH) logs, per step, the whole-KV-cache
copies reshape_and_cache made (_core.cache_write_copies), whether the previous step
was still waiting to be read when the step was built, and the kernel backend.
"""

from __future__ import annotations

import concurrent.futures as cf
import os

import numpy as np
import pytest

from serving_harness import Server, runner_hook

pytestmark = [pytest.mark.slow, pytest.mark.serving]

EMULATED_GPU_PATH = {"VLLM_METAL_KERNELS": "emulated"}
# float32: vLLM's dtype "auto" would serve a float32 checkpoint in half precision
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
               "--num-gpu-blocks-override", "48",
               "--max-num-batched-tokens", "32"]
VOCAB = 320

STEP_LOG_HOOK = runner_hook(
    """
    import os


    def wrap(execute_model):
        from vllm_metal import _core, ops

        log = open(os.environ["KV_COPY_LOG"], "a")

        def logged_execute_model(self, so):
            in_flight = bool(self._deferred) and self._deferred[-1].tokens is None
            before = _core.cache_write_copies()
            out = execute_model(self, so)
            if so.total_num_scheduled_tokens:
                from vllm_metal.models.fused_layers import runs_fused_kernels

                layer_op = bool(self.model.__dict__.get("_fused_plan"))
                fused = layer_op + (layer_op and runs_fused_kernels(so.total_num_scheduled_tokens))
                log.write(f"{_core.cache_write_copies() - before} {int(in_flight)} "
                          f"{int(fused)} {ops.kernel_backend()}\\n")
                log.flush()
            return out

        return logged_execute_model
    """
)


def tiny_attention_checkpoint(name: str, out_dir):
    """A 2-layer checkpoint of `name` (llama, gemma3) with a head size the Metal kernels
    take, and a byte-level tokenizer."""
    from qwen3_5_checkpoint import write_tokenizer
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    # untied: with tied embeddings a tiny random model mostly repeats its last input token
    cfg = tiny_config(name, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=VOCAB,
                      tie_word_embeddings=False)
    out = write_random_checkpoint(cfg, out_dir, seed=3)
    write_tokenizer(out, VOCAB)
    return out


def serve_emulated(checkpoint, name: str, tmp_path, extra_env=None) -> tuple[Server, object]:
    (tmp_path / "sitecustomize.py").write_text(STEP_LOG_HOOK)
    log = tmp_path / "steps.log"
    env = {**EMULATED_GPU_PATH, **(extra_env or {}), "KV_COPY_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return Server(str(checkpoint), name, SERVER_ARGS, env=env), log


def complete(server, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The greedy tokens and the logprob of each."""
    r = server.client.post("/v1/completions", json={
        "model": server.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


# concurrent requests of different lengths: decodes share steps with chunked prefills
JOBS = [(np.random.default_rng(n).integers(3, VOCAB, n).tolist(), m)
        for n, m in [(3, 12), (41, 8), (17, 10), (29, 6), (8, 14)]]


def serve_concurrently(server) -> list[tuple[list[int], list[float]]]:
    with cf.ThreadPoolExecutor(len(JOBS)) as pool:
        return list(pool.map(lambda j: complete(server, *j), JOBS))


def tiny_qwen3_5_checkpoint(out_dir):
    """Qwen3.5 with one linear-attention (gated delta net) and one attention layer."""
    from qwen3_5_checkpoint import CONFIG, write_checkpoint

    cfg = dict(CONFIG, num_hidden_layers=2, full_attention_interval=2, head_dim=64,
               layer_types=["linear_attention", "full_attention"],
               rope_parameters=dict(CONFIG["rope_parameters"], mrope_section=[4, 2, 2]))
    return write_checkpoint(out_dir, seed=1, config=cfg)


def log_softmax_of(logits: np.ndarray, tokens: list[int]) -> list[float]:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    z = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return [float(z[i, t]) for i, t in enumerate(tokens)]


def cpu_path(checkpoint, arch: str) -> list[tuple[list[int], list[float]]]:
    """Each job alone on the native CPU kernels: its greedy tokens (decoded one by one) and
    their logprobs (qwen3.5: from the same decode; the others: the logits of the prompt and
    tokens run as one prefill)."""
    from qwen3_5_checkpoint import run_packed_greedy
    from vllm_metal import ops
    from vllm_metal.models import load_model
    from vllm_metal.models.generate import greedy_generate
    from vllm_metal.models.testing import run_packed

    assert ops.kernel_backend() == "native"
    loaded = load_model(str(checkpoint), "float32")
    out = []
    for prompt, n in JOBS:
        if arch == "qwen3_5":
            tokens, rows = run_packed_greedy(loaded, [prompt], n, chunk=16)
            out.append((tokens[0], log_softmax_of(np.stack(rows[0]), tokens[0])))
            continue
        tokens = greedy_generate(loaded, [prompt], n, stop_ids=[])[0]
        seq = prompt + tokens
        logits = run_packed(loaded, [seq], [[len(seq)]])[0][len(prompt) - 1:-1]
        out.append((tokens, log_softmax_of(logits, tokens)))
    return out


ARCHS = ["llama", "gemma3", "qwen3_5"]


def serve_one(arch: str, tmp) -> tuple:
    if arch == "qwen3_5":
        checkpoint = tiny_qwen3_5_checkpoint(tmp / "checkpoint")
    else:
        checkpoint = tiny_attention_checkpoint(arch, tmp / "checkpoint")
    server, log = serve_emulated(checkpoint, f"{arch}-tiny", tmp)
    try:
        got = serve_concurrently(server)
    finally:
        server.stop()
    return checkpoint, got, step_log(log)


def step_log(log) -> list[tuple[int, int]]:
    lines = [line.split() for line in log.read_text().splitlines()]
    # the Metal kernels in the emulator (the fused layers run their Metal plan)
    assert lines and all(backend == "emulated" for *_, backend in lines), lines[:3]
    return [(int(copies), int(in_flight), int(fused)) for copies, in_flight, fused, _ in lines]


def serve_batch_invariant(tmp) -> tuple:
    """The llama checkpoint with VLLM_BATCH_INVARIANT=1: the jobs served concurrently, then
    each alone on the same server."""
    checkpoint = tiny_attention_checkpoint("llama", tmp / "checkpoint")
    server, log = serve_emulated(checkpoint, "llama-tiny", tmp, {"VLLM_BATCH_INVARIANT": "1"})
    try:
        batched = serve_concurrently(server)
        alone = [complete(server, *job) for job in JOBS]
    finally:
        server.stop()
    step_log(log)
    return batched, alone


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """arch -> (checkpoint, (tokens, logprobs) served per job, (copies, previous step in
    flight) per step).
    The three servers run side by side: their start-up (mostly vLLM's) dominates."""
    with cf.ThreadPoolExecutor(len(ARCHS) + 1) as pool:
        futures = {a: pool.submit(serve_one, a, tmp_path_factory.mktemp(a)) for a in ARCHS}
        futures["invariant"] = pool.submit(serve_batch_invariant, tmp_path_factory.mktemp("invariant"))
        return {a: f.result() for a, f in futures.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_emulated_gpu_path_gives_the_cpu_path_tokens(served, arch):
    checkpoint, got, _ = served[arch]
    want = cpu_path(checkpoint, arch)
    assert [len(tokens) for tokens, _ in want] == [m for _, m in JOBS]
    assert len({t for tokens, _ in want for t in tokens}) > 5  # not a degenerate checkpoint
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(got, want)):
        where = f"{arch}: job {i} (prompt of {len(JOBS[i][0])} tokens)"
        assert tokens == want_tokens, where
        # float32 sums in other orders (Metal vs CPU kernels, batched vs alone) differ by at most
        # ~2e-6 here; a real error (a 2% attention scale) moves them by far more
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0, err_msg=where)


@pytest.mark.parametrize("arch", ARCHS)
def test_async_steps_write_the_kv_cache_in_place(served, arch):
    _, got, steps = served[arch]
    assert [len(tokens) for tokens, _ in got] == [m for _, m in JOBS]
    overlapped = [copies for copies, in_flight, _ in steps if in_flight]
    # the previous step was still unread (computing) when most steps were built
    assert len(overlapped) >= 10, steps
    assert sum(copies for copies, _, _ in steps) == 0, f"{arch}: KV-cache copies per step: {steps}"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_steps_run_the_metal_decoder_layer(served, arch):
    """The attention architectures' steps all ran decoder_layer's Metal plan (its caches
    written in place too: no copies, above): the short ones on the fused kernels (2), the
    prefill-heavy ones on the per-op kernels in the op's plan (1)."""
    kinds = {f for _, _, f in served[arch][2]}
    assert kinds == {1, 2}, served[arch][2]


def test_batch_invariant_mode_gives_each_request_its_solo_logprobs_bitwise(served):
    # The default Metal plans sum a row differently batched (mat-mat tiles past 8 rows, the
    # prefill attention kernel, split-KV by batch size): VLLM_BATCH_INVARIANT=1 must not.
    batched, alone = served["invariant"]
    for i, (b, a) in enumerate(zip(batched, alone)):
        assert b == a, f"job {i} (prompt of {len(JOBS[i][0])} tokens): batched != alone"


# prompts that repeat themselves, so the n-gram matcher proposes drafts
SPEC_JOBS = [([5 + (i % 7) for i in range(n)], m) for n, m in [(21, 14), (9, 12), (30, 10)]]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_speculative_decoding_on_the_emulated_gpu_path(tmp_path, method):
    """Speculation on the Metal path (steps with several tokens of one request, its drafts,
    through the decoder layer's plan): the greedy tokens of the CPU path decoded one token
    at a time, and drafts proposed and kept. draft_model: the checkpoint drafts for itself
    (its cache and decode passes on the emulated kernels too). eagle3: a random head (its
    drafts mostly rejected) reading the target's inner states through the Metal plan."""
    import json
    import re

    from vllm_metal.models import load_model
    from vllm_metal.models.generate import greedy_generate

    checkpoint = tiny_attention_checkpoint("llama", tmp_path / "checkpoint")
    loaded = load_model(str(checkpoint), "float32")
    want = [greedy_generate(loaded, [p], m, stop_ids=[])[0] for p, m in SPEC_JOBS]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    if method == "draft_model":
        spec = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3}
    if method == "eagle3":
        from vllm_metal.models.testing import write_random_eagle3_head

        args = loaded.model.lm.args
        head, *_ = write_random_eagle3_head(tmp_path / "head", args.hidden_size, args.vocab_size,
                                            draft_vocab=args.vocab_size // 2, aux=[1, 1, 2],
                                            heads=args.num_attention_heads,
                                            kv=args.num_key_value_heads)
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    (tmp_path / "sitecustomize.py").write_text(STEP_LOG_HOOK)
    env = {**EMULATED_GPU_PATH, "KV_COPY_LOG": str(tmp_path / "steps.log"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    server = Server(str(checkpoint), "llama-tiny",
                    SERVER_ARGS + ["--speculative-config", json.dumps(spec)], env=env)
    try:
        with cf.ThreadPoolExecutor(len(SPEC_JOBS)) as pool:
            got = list(pool.map(lambda j: complete(server, *j)[0], SPEC_JOBS))
        metrics = server.client.get("/metrics").text
    finally:
        server.stop()
    step_log(tmp_path / "steps.log")  # the emulated Metal kernels ran
    assert got == want

    def total(name):
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", metrics, re.M))

    if method == "eagle3":
        assert total("vllm:spec_decode_num_draft_tokens_total") > 0
    else:
        assert total("vllm:spec_decode_num_accepted_tokens_total") > 0
