"""Deterministic request mixes (fixed seeds), as prompt token lengths and output lengths.

  random-128-128    every request 128 prompt tokens, 128 output tokens
  random-1024-128   1024 prompt tokens, 128 output tokens
  sharegpt-like     lengths drawn like ShareGPT conversations (log-normal: prompt
                    median ~200 tokens, output median ~150, clipped to 16..1024 and
                    16..256); the dataset itself is not reachable offline

Prompts are random words from the model's vocabulary, cut to the target length
with the model's own tokenizer (servers re-tokenize text; their usage reports
say what they counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Request:
    prompt: str
    prompt_tokens: int
    max_tokens: int


MIXES = ("random-128-128", "random-1024-128", "sharegpt-like")


def lengths(mix: str, n: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    if mix.startswith("random-"):
        _, p, o = mix.split("-")
        return [(int(p), int(o))] * n
    if mix == "sharegpt-like":
        p = np.clip(rng.lognormal(np.log(200), 0.9, n), 16, 1024).astype(int)
        o = np.clip(rng.lognormal(np.log(150), 0.7, n), 16, 256).astype(int)
        return list(zip(p.tolist(), o.tolist()))
    raise ValueError(f"unknown mix {mix!r}; known: {', '.join(MIXES)}")


def make_requests(tokenizer, mix: str, n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed + 1)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2]
    words.sort()
    out = []
    for p_len, o_len in lengths(mix, n, seed):
        text = " ".join(rng.choice(words, size=p_len))
        ids = tokenizer.encode(text, add_special_tokens=False)[:p_len]
        out.append(Request(tokenizer.decode(ids), len(ids), o_len))
    return out
