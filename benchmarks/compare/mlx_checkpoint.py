"""The same weights for mlx-lm, which reads safetensors directories, not GGUF:
the GGUF's tensors dequantized (HF layout, mlx-lm names, float16) next to the
config and tokenizer that prepare_gguf_dir derives from the same file. Cached
beside the prepared directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

from vllm_metal.models import gguf_loader, prepare_gguf_dir


def mlx_checkpoint(gguf: str, dtype=mx.float16) -> str:
    prepared = Path(prepare_gguf_dir(gguf))
    out = prepared.with_name(prepared.name + "-mlx-lm")
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
    config["torch_dtype"] = "float16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return str(out)
