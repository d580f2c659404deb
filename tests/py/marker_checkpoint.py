"""The tiny random-weight Qwen3.5 checkpoint of qwen3_5_checkpoint.py with a tokenizer that
has the single-token markers reasoning and tool parsers look for (<think>, </think>,
<tool_call>, </tool_call>, <|python_tag|>, as Qwen3 and Llama 3 tokenizers have them) and a
Qwen3-style chat template whose generation prompt opens a thinking section.
"""

from __future__ import annotations

import json
from pathlib import Path

from qwen3_5_checkpoint import VOCAB, write_checkpoint

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>"]
# ids VOCAB - 5 .. VOCAB - 1, inside the model's vocabulary
MARKER_IDS = {m: VOCAB - len(MARKERS) + i for i, m in enumerate(MARKERS)}

# the prompt ends inside a thinking section (Qwen3's template with thinking on), unless
# the request passes chat_template_kwargs={"enable_thinking": false}
CHAT_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{%- else %}<think>{%- endif %}{%- endif %}")


def write_marker_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vllm_metal.models.testing import byte_level_vocab

    tokens, _, merges = byte_level_vocab(VOCAB - len(MARKERS))
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                     merges=[tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # not special: they stay in the decoded text, where the parsers read them
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|im_start|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    assert fast.convert_tokens_to_ids(MARKERS) == list(MARKER_IDS.values())


def write_marker_checkpoint(out_dir, seed: int = 0) -> Path:
    out = write_checkpoint(out_dir, seed=seed)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).unlink(missing_ok=True)
    write_marker_tokenizer(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config.get("chat_template") or (out / "chat_template.jinja").exists()
    return out
