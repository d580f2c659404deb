"""python -m vllm_metal.models {smollm2|gemma3|PATH.gguf} [--gguf] [--prompt TEXT [--max-tokens N]]

Prints the path of the prepared directory (config, tokenizer, model.gguf link)
of an offline model or a GGUF file, ready for `vllm serve`; --gguf prints the
GGUF file instead. With --prompt, also greedily answers a chat prompt with our
model (on stderr), as a smoke check without vLLM.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from vllm_metal.models.offline import OFFLINE_GGUF, OfflineModelMissing

    parser = argparse.ArgumentParser(prog="python -m vllm_metal.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help=f"{' | '.join(OFFLINE_GGUF)} | path to a .gguf file")
    parser.add_argument("--gguf", action="store_true", help="print the GGUF file's path")
    parser.add_argument("--prompt", help="chat prompt to answer greedily (printed on stderr)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args(argv)

    try:
        gguf_path = OFFLINE_GGUF[args.model]() if args.model in OFFLINE_GGUF else args.model
    except OfflineModelMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.gguf:
        print(gguf_path)
        return 0
    from vllm_metal.models import prepare_gguf_dir

    directory = prepare_gguf_dir(str(gguf_path))
    if args.prompt:
        _answer(directory, args.prompt, args.max_tokens, args.dtype)
    print(directory)
    return 0


def _answer(directory: str, prompt: str, max_tokens: int, dtype: str | None) -> None:
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        from transformers import AutoTokenizer

        from vllm_metal.models import load_model
        from vllm_metal.models.generate import greedy_generate

        tok = AutoTokenizer.from_pretrained(directory)
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        loaded = load_model(directory, dtype)
        out = greedy_generate(loaded, [list(ids)], max_tokens)[0]
        print(tok.decode(out, skip_special_tokens=True))


if __name__ == "__main__":
    sys.exit(main())
