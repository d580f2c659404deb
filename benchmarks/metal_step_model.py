"""The Metal decode step of real models, dispatch by dispatch, and its predicted time on
Apple GPUs.

Each model loads as it runs on a Mac (the GPU path: dense layers on MLX, our ops on their
Metal kernels, here in the emulator), then one decode step at batch B and context C (the
sampler included) is recorded by step_recorder on both layer paths: the fused Metal
decoder layer (what serving runs) and the per-op layers (VLLM_METAL_FUSED_LAYERS=0): our
kernel launches with the bytes the emulator's counting builds measured, MLX's own kernels
from their shapes, views free. Per layer = the step of a 2-layer truncation minus the
1-layer one.

Predicted step time per chip = sum over dispatches of max(bytes / bandwidth, flops / fp16
rate) + dispatches x the published per-dispatch cost (apple_published.DISPATCH_US).

    .venv/bin/python benchmarks/metal_step_model.py            # all models, rewrites docs
    .venv/bin/python benchmarks/metal_step_model.py --models smollm2 --batches 1 --no-write
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import apple_published as pub  # noqa: E402
import step_recorder as sr  # noqa: E402
from doc_sections import write_section  # noqa: E402
from metal_roofline import DOC, MACHINES  # noqa: E402

MODELS = {"smollm2": "SmolLM2-135M Q4_1", "gemma3": "Gemma-3-270M Q4_K_M"}
BLOCK = 16


@contextlib.contextmanager
def gpu_path():
    """Load models as on an Apple GPU: linear_choice sees a GPU (dense layers stay on MLX)
    and ops run their Metal kernels (emulated; the recorder runs steps on the emulated
    backend too, so fused layers run their Metal plan)."""
    from vllm_metal import ops
    from vllm_metal.models import linear_choice

    saved, backend = linear_choice.model_runs_on_gpu, ops.kernel_backend()
    linear_choice.model_runs_on_gpu = lambda: True
    ops.set_kernel_backend("emulated")
    try:
        yield
    finally:
        linear_choice.model_runs_on_gpu = saved
        ops.set_kernel_backend(backend)


def load(name_or_path: str):
    from vllm_metal.models import load_model
    from vllm_metal.models.offline import OFFLINE_GGUF

    path = OFFLINE_GGUF[name_or_path]() if name_or_path in OFFLINE_GGUF else name_or_path
    with gpu_path():
        loaded = load_model(str(path))
    mx.eval(loaded.model.parameters())
    return loaded


@contextlib.contextmanager
def layer_path(model, fused: bool):
    """Run `model` (a PagedCausalLM) on the fused layers or the per-op ones; the fused
    plan is rebuilt from model.layers on entry and exit (it holds the layers it saw)."""
    name = "VLLM_METAL_FUSED_LAYERS"
    saved = os.environ.get(name)
    os.environ[name] = "1" if fused else "0"
    model.reset_fused_layers()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name)
        else:
            os.environ[name] = saved
        model.reset_fused_layers()


class DecodeStep:
    """`batch` sequences with `context` cached tokens each (cache contents do not change
    what runs), decoding one token each on the fused layers or the per-op ones; the KV
    pool is allocated and evaluated once."""

    def __init__(self, loaded, batch: int, context: int, fused: bool = True):
        from vllm_metal.models.generate import KVPool

        self.loaded, self.batch, self.context, self.fused = loaded, batch, context, fused
        per_seq = -(-(context + 1) // BLOCK)
        self.pool = KVPool(loaded.spec, per_seq * batch + 1, BLOCK)
        mx.eval(self.pool.kv_caches)
        self.tables = []
        for _ in range(batch):
            table = []
            self.pool.allocate(table, context + 1)
            self.tables.append(table)

    def outputs(self, num_layers: int | None = None):
        """The step's lazy outputs (sampled tokens, updated caches) through the first
        num_layers layers (None: all)."""
        from vllm_metal.models.generate import SeqChunk, build_step

        model = self.loaded.model
        chunks = [SeqChunk([3 + i], self.context, t) for i, t in enumerate(self.tables)]
        step = build_step(chunks, self.pool.kv_caches, BLOCK)
        layers = model.lm.model.layers
        with layer_path(model, self.fused):
            if num_layers is not None:
                model.lm.model.layers = layers[:num_layers]
            try:
                logits = model(step.input_ids, step.ctx)
            finally:
                model.lm.model.layers = layers
        tokens = greedy_sampler()(logits, greedy_batch(self.batch, logits.shape[-1])).tokens
        return [tokens] + [c for kv in step.ctx.kv_caches for c in kv]

    def record(self, num_layers: int | None = None, reuse_counts: bool = False) -> sr.StepRecord:
        return sr.record(lambda: self.outputs(num_layers), reuse_counts)


def greedy_sampler():
    from vllm_metal.sampling.sampler import Sampler

    return Sampler()


def greedy_batch(batch: int, vocab: int):
    """The sampling parameters of `batch` greedy requests (vLLM's temperature 0)."""
    import numpy as np

    from vllm_metal.sampling.batch import SamplingBatch

    z = np.zeros(batch, np.float32)
    return SamplingBatch(vocab_size=vocab, temperature=z, top_k=np.full(batch, vocab, np.int32),
                         top_p=np.ones(batch, np.float32), min_p=z, repetition_penalty=np.ones(batch, np.float32),
                         frequency_penalty=z, presence_penalty=z, uniforms=np.zeros(batch))


def layer_split(one: sr.StepRecord, two: sr.StepRecord):
    """(per-layer dispatches, the rest): the second layer is what a 2-layer step adds."""
    extra = collections.Counter(d.key for d in two.dispatches)
    extra.subtract(collections.Counter(d.key for d in one.dispatches))
    if any(v < 0 for v in extra.values()):
        raise RuntimeError("a 2-layer step lacks dispatches of the 1-layer step")
    layer, want = [], dict(extra)
    for d in two.dispatches:  # same key: same op, kernel and shapes, so the same counts
        if want.get(d.key, 0) > 0:
            layer.append(d)
            want[d.key] -= 1
    outside = list(one.dispatches)
    for d in layer:
        for i, o in enumerate(outside):
            if o.key == d.key:
                del outside[i]
                break
    return layer, outside


def step_time_us(dispatches, gbs: float, tflops: float, dispatch_us: float) -> tuple[float, float]:
    """(roofline us, dispatch overhead us) of a list of dispatches on one chip."""
    roof = sum(max(d.bytes / (gbs * 1e3), d.flops / (tflops * 1e6)) for d in dispatches)
    return roof, len(dispatches) * dispatch_us


def analyse(key: str, loaded, batch: int, context: int, fused: bool = True) -> dict:
    t0 = time.time()
    step = DecodeStep(loaded, batch, context, fused)
    full = step.record()
    one, two = step.record(1, reuse_counts=True), step.record(2, reuse_counts=True)
    layer, outside = layer_split(one, two)
    num_layers = loaded.spec.num_layers
    expected = len(outside) + num_layers * len(layer)
    if expected != full.count():
        raise RuntimeError(f"{key}: {full.count()} dispatches, but {len(outside)} + "
                           f"{num_layers} x {len(layer)} from the truncated steps")
    machines = {}
    for name, gbs, tflops in MACHINES:
        roof, over = step_time_us(full.dispatches, gbs, tflops, pub.DISPATCH_US)
        machines[name] = {"roofline_us": roof, "dispatch_us": over,
                          "tok_s": batch * 1e6 / (roof + over), "bound_tok_s": batch * 1e6 / roof}
    kinds = collections.Counter(d.kernel for d in layer)
    return {
        "model": MODELS.get(key, key), "batch": batch, "context": context,
        "path": "fused" if fused else "per-op",
        "layers": num_layers, "dtype": loaded.spec.dtype,
        "dispatches": full.count(), "ours": full.count(sr.OURS), "mlx": full.count(sr.MLX),
        "views": sum(full.views.values()), "nodes": full.nodes,
        "layer_dispatches": len(layer), "layer_ours": sum(d.source == sr.OURS for d in layer),
        "layer_mlx": sum(d.source == sr.MLX for d in layer),
        "layer_kinds": dict(kinds), "outside_kinds": dict(collections.Counter(d.kernel for d in outside)),
        "bytes": full.total("bytes"), "mlx_bytes": full.total("bytes", sr.MLX),
        "flops": full.total("flops"), "layer_bytes": sum(d.bytes for d in layer),
        "layer_flops": sum(d.flops for d in layer),
        "sampled": sum(d.sampled for d in full.dispatches),
        "machines": machines, "seconds": round(time.time() - t0, 1),
        "_layer": layer, "_outside": outside,
    }


def step_table(results) -> str:
    names = [m[0] for m in MACHINES]
    out = [
        f"One decode step on the GPU path, recorded from the step's MLX graph "
        f"(`benchmarks/metal_step_model.py`): every sequence at context {results[0]['context']}, "
        f"greedy sampling included. Dispatches: ours (our kernels' launches, run in the emulator) "
        f"and MLX's (kernels from MLX's Metal backend: copies, elementwise, gathers, casts, "
        f"argmax); views are free. Bytes: unique device bytes (ours counted by the emulator's "
        f"counting builds, MLX's from shapes). Predicted time per step = Σ max(bytes / bandwidth, "
        f"flops / fp16 rate) + dispatches × {pub.DISPATCH_US:.2f} µs "
        f"([per-dispatch cost]({pub.DISPATCH_SOURCE}): MLX maintainers' issue, M3 Ultra, a chain "
        f"of 3,200 tiny dependent kernels in 8.8 ms). A model, not a measurement: no Mac ran it.",
        "",
        "| model | layers | batch | dispatches (ours + MLX) | per layer (ours + MLX) | MB | per layer MB | "
        "GFLOP | per layer MFLOP | " + " | ".join(f"{n} µs (roofline + dispatch) → tok/s" for n in names) + " |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---|" * len(names),
    ]
    for r in results:
        cells = []
        for n in names:
            m = r["machines"][n]
            cells.append(f"{m['roofline_us']:.0f} + {m['dispatch_us']:.0f} → **{m['tok_s']:.0f}**")
        out.append(
            f"| {r['model']} ({r['dtype']}) | {r['path']} | {r['batch']} | {r['dispatches']} ({r['ours']} + {r['mlx']}) | "
            f"{r['layer_dispatches']} ({r['layer_ours']} + {r['layer_mlx']}) | {r['bytes'] / 1e6:.1f} | "
            f"{r['layer_bytes'] / 1e6:.2f} | {r['flops'] / 1e9:.2f} | {r['layer_flops'] / 1e6:.1f} | "
            + " | ".join(cells) + " |")
    return "\n".join(out)


def layer_table(r) -> str:
    """The dispatches of one layer, for the model and batch of `r`."""
    rows = collections.defaultdict(lambda: [0, 0])
    for d in r["_layer"]:
        rows[(d.source, d.kernel)][0] += 1
        rows[(d.source, d.kernel)][1] += d.bytes
    out = [f"Dispatches of one layer: {r['model']}, {r['path']} layers, batch {r['batch']}, "
           f"context {r['context']} "
           f"({r['layer_dispatches']} per layer; outside the layers: "
           + ", ".join(f"{k} × {v}" for k, v in sorted(r["outside_kinds"].items())) + ").",
           "", "| source | kernel | per layer | KB |", "|---|---|---:|---:|"]
    for (source, kernel), (n, b) in sorted(rows.items()):
        out.append(f"| {source} | {kernel} | {n} | {b / 1024:.1f} |")
    return "\n".join(out)


def run(models, batches, context: int, paths=(True, False)) -> list:
    results = []
    for key in models:
        t0 = time.time()
        loaded = load(key)
        print(f"{key}: loaded in {time.time() - t0:.0f} s", flush=True)
        for fused, batch in ((f, b) for f in paths for b in batches):
            r = analyse(key, loaded, batch, context, fused)
            print(f"{key} {r['path']} batch {batch}: {r['dispatches']} dispatches ({r['ours']} ours + {r['mlx']} MLX), "
                  f"{r['layer_dispatches']} per layer, {r['bytes'] / 1e6:.1f} MB, {r['seconds']} s", flush=True)
            results.append(r)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="offline model names or .gguf paths")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--paths", nargs="+", choices=["fused", "per-op"], default=["fused", "per-op"],
                    help="layer paths to record (fused: what serving runs)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    results = run(args.models, args.batches, args.context, [p == "fused" for p in args.paths])
    text = step_table(results) + "\n\n" + "\n\n".join(layer_table(r) for r in results if r["batch"] == 1)
    print(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")} for r in results], indent=1))
    print(text)
    templates = {r["path"]: r for r in results if r["model"] == MODELS["smollm2"] and r["batch"] == 1}
    llama = None
    if templates:  # the llama-architecture paths, mapped to LLaMA-2 7B
        import llama7b_projection as lp

        projected = {path: lp.project(r["_layer"], r["_outside"], lp.CONTEXT) for path, r in templates.items()}
        llama = lp.table(projected, lp.CONTEXT)
        print(llama)
    if not args.no_write:
        write_section(DOC, "metal_step_model", text)
        if llama:
            write_section(DOC, "llama_cpp_vs_ours", llama)
    return 0


if __name__ == "__main__":
    sys.exit(main())
