"""What 8-bit activations (VLLM_METAL_INT8_ACTIVATIONS=1, llama.cpp's scheme) change in a
model's output on the CPU, against float32 sums (the default, what the Metal kernels
compute): the evidence behind the CPU default (docs/gguf.md, "The CPU activation scheme").

    .venv/bin/python benchmarks/activation_accuracy.py [--models smollm2,gemma3] [--tokens 48]

Reference: the float32 model with float32 sums. Each question is answered greedily by the
reference; each other mode then (a) reads the reference's prompt + answer (teacher-forced)
and is scored per answer position: top-1 agreement and KL(reference || mode), and (b)
answers greedily itself, scored by how many answers equal the reference's token for token.
Prints a markdown table and one JSON line per (model, mode).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from vllm_metal.models import load_model, prepare_gguf_dir
from vllm_metal.models.generate import greedy_generate
from vllm_metal.models.offline import OFFLINE_GGUF
from vllm_metal.models.testing import run_packed

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What does a compiler do?",
    "Explain photosynthesis in one sentence.",
    "Give me a synonym for happy.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
    "Why is the sky blue?",
    "Suggest a name for a black cat.",
    "What is the boiling point of water in Fahrenheit?",
]
MODES = [("float32", False), ("float32", True), ("float16", False), ("float16", True)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def measure(model: str, tokens: int) -> list[dict]:
    from transformers import AutoTokenizer

    directory = prepare_gguf_dir(str(OFFLINE_GGUF[model]()))
    tok = AutoTokenizer.from_pretrained(directory)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]) for q in QUESTIONS]
    reference = load_model(directory, "float32", int8_activations=False)
    answers = greedy_generate(reference, prompts, tokens)
    sequences = [p + a for p, a in zip(prompts, answers)]
    schedules = [[len(s)] for s in sequences]

    def answer_logits(loaded):
        out = run_packed(loaded, sequences, schedules, block_size=16,
                         num_blocks=sum(-(-len(s) // 16) for s in sequences) + 1)
        # the logits that predict each answer token
        return [o[len(p) - 1:len(s) - 1] for o, p, s in zip(out, prompts, sequences)]

    ref_logits = answer_logits(reference)
    rows = []
    for dtype, int8 in MODES:
        loaded = load_model(directory, dtype, int8_activations=int8)
        logits = answer_logits(loaded)
        agree, kl = [], []
        for r, m in zip(ref_logits, logits):
            lr, lm = log_softmax(r.astype(np.float64)), log_softmax(m.astype(np.float64))
            agree += list(r.argmax(-1) == m.argmax(-1))
            kl += list((np.exp(lr) * (lr - lm)).sum(-1))
        own = greedy_generate(loaded, prompts, tokens)
        rows.append({
            "model": model, "dtype": dtype,
            "activations": "8-bit" if int8 else "float32 sums",
            "positions": len(agree), "top1_agreement": float(np.mean(agree)),
            "kl_mean": float(np.mean(kl)), "kl_max": float(np.max(kl)),
            "same_answers": sum(a == b for a, b in zip(own, answers)), "answers": len(answers),
            "capital_of_france": tok.decode(own[0], skip_special_tokens=True)[:60],
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    rows = [r for m in args.models.split(",") for r in measure(m, args.tokens)]
    print("| model | dtype | activations | top-1 agreement | KL mean / max (nats) | "
          "greedy answers equal | answer to 'capital of France?' |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dtype']} | {r['activations']} | {100 * r['top1_agreement']:.1f} % "
              f"| {r['kl_mean']:.4f} / {r['kl_max']:.3f} | {r['same_answers']} of {r['answers']} "
              f"| {r['capital_of_france']!r} |")
    print("# JSON")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
