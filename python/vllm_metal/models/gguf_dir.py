"""prepare_gguf_dir: a directory vLLM's front end can read, made from a GGUF file.

    <dir>/config.json             HF config from the GGUF metadata (gguf_loader.hf_config)
    <dir>/generation_config.json  bos / eos (incl. end-of-turn tokens)
    <dir>/tokenizer.json, tokenizer_config.json (+ chat_template.jinja)
                                  transformers' GGUF tokenizer conversion, with the
                                  file's add_bos/add_eos flags and chat template
    <dir>/model.gguf -> the file  (symlink; load_model reads the weights through it)
    <dir>/modules.json, 1_Pooling/config.json
                                  for an embedding file (`<arch>.pooling_type` MEAN, CLS
                                  or LAST): the sentence-transformers layout vLLM reads its
                                  pooler config from, normalised as llama.cpp's server does

Cached under $XDG_CACHE_HOME (default ~/.cache)/vllm_metal/gguf/<key>, the key
hashing the file's resolved path, size and mtime and the layout version. The
directory is built in a temporary sibling and renamed into place under a file
lock, so concurrent processes neither see a half-written directory nor
build it twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from vllm_metal.models import bert_gguf
from vllm_metal.models.gguf_loader import GGUF_FILE_IN_DIR

LAYOUT_VERSION = 9  # 7: pooling_type -> sentence-transformers modules; 8: bert files;
# 9: bert RANK files as BertForSequenceClassification
_DONE_MARKER = ".vllm_metal_prepared"

# Used when a Gemma 3 GGUF carries no chat template (HF's Gemma turn format:
# no system role, so a system message prefixes the next user turn).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = message['content'] ~ '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' ~ role ~ '\\n' ~ (ns.system ~ message['content']) | trim ~ '<end_of_turn>\\n' }}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm_metal" / "gguf"


def cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    ident = f"{LAYOUT_VERSION}\0{gguf_path}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def prepare_gguf_dir(gguf_path: str, out_dir: str | None = None) -> str:
    src = Path(gguf_path).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"[vllm-metal] GGUF file not found: {gguf_path}")
    key = cache_key(src)
    target = Path(out_dir).expanduser().resolve() if out_dir else cache_root() / key
    if _is_done(target, key):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_done(target, key):  # another process finished while we waited
            return str(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
        try:
            _write_dir(src, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private
            (tmp / _DONE_MARKER).write_text(key)
            if not target.exists():
                os.rename(tmp, target)
            else:  # an out_dir given by the caller, or a stale one: replace file by file
                for item in sorted(tmp.iterdir(), key=lambda p: p.name == _DONE_MARKER):
                    dest = target / item.name
                    if dest.is_symlink() or dest.is_file():
                        dest.unlink()
                    elif dest.is_dir():
                        shutil.rmtree(dest)
                    os.replace(item, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _is_done(target: Path, key: str) -> bool:
    try:
        return (target / _DONE_MARKER).read_text() == key
    except OSError:
        return False


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_dir(src: Path, out: Path) -> None:
    from vllm_metal.models import gguf_loader

    ckpt = gguf_loader.GGUFCheckpoint(str(src))
    if bert_gguf.is_bert(ckpt):  # an encoder: its own config and WordPiece tokenizer
        _write_bert_dir(src, out, ckpt)
        return
    config = gguf_loader.hf_config(ckpt)
    eos = gguf_loader.eos_token_ids(ckpt)
    os.symlink(src, out / GGUF_FILE_IN_DIR)
    # Tokenizer first: transformers picks the tokenizer class from the GGUF alone.
    _write_tokenizer(out, ckpt, config)
    import transformers

    # transformers_version as save_pretrained writes it: without it transformers >= 5
    # suspects an old Mistral tokenizer config and warns about its regex.
    config = dict(config, transformers_version=transformers.__version__)
    if pooling_type_of(ckpt) == _RANK_POOLING:
        config["gguf_pooling_type"] = "RANK"  # a reranker file: the platform refuses it
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    for key in ("bos_token_id", "pad_token_id"):
        if key in config:
            generation[key] = config[key]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_pooling_modules(out, ckpt)


def _write_bert_dir(src: Path, out: Path, ckpt) -> None:
    import transformers

    # a RANK file comes out as BertForSequenceClassification (its cls / cls.output head)
    config = dict(bert_gguf.hf_config(ckpt), transformers_version=transformers.__version__)
    os.symlink(src, out / GGUF_FILE_IN_DIR)
    with contextlib.redirect_stdout(sys.stderr):
        bert_gguf.write_tokenizer(out, ckpt)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_pooling_modules(out, ckpt)


# llama.cpp's pooling_type metadata (gguf.PoolingType) -> sentence-transformers' pooling_mode
_POOLING_MODES = {1: "mean", 2: "cls", 3: "lasttoken"}
_RANK_POOLING = 4


def pooling_type_of(ckpt) -> int | None:
    """`<arch>.pooling_type` of a GGUF file (0 none, 1 mean, 2 cls, 3 last, 4 rank)."""
    value = ckpt.metadata.get(f"{ckpt.architecture}.pooling_type")
    return None if value is None else int(value)


def _write_pooling_modules(out: Path, ckpt) -> None:
    """An embedding GGUF's pooling, as vLLM reads it from a sentence-transformers model:
    Transformer -> Pooling -> Normalize (llama.cpp's server normalises embeddings too).
    RANK files (rerankers with a cls.output head) have none: a BERT one is served as a
    sequence classifier (bert_gguf), the others are marked in config.json and refused."""
    mode = _POOLING_MODES.get(pooling_type_of(ckpt))
    if mode is None:
        return
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": int(ckpt.metadata[f"{ckpt.architecture}.embedding_length"]),
              "pooling_mode": mode}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# GGUF architectures whose files transformers' GGUF reader refuses outright, though their
# tokenizer metadata is the usual one
_TOKENIZER_ONLY_ARCHS = {"olmoe"}
_TOKENIZER_ONLY_FILE = "tokenizer-source.gguf"


def _tokenizer_source(out: Path, ckpt) -> str:
    """The file (in `out`) transformers reads the tokenizer from: the model itself, or for
    _TOKENIZER_ONLY_ARCHS a file holding only its tokenizer.* metadata under arch llama."""
    if ckpt.architecture not in _TOKENIZER_ONLY_ARCHS:
        return GGUF_FILE_IN_DIR
    import gguf

    reader = gguf.GGUFReader(ckpt.path)
    w = gguf.GGUFWriter(str(out / _TOKENIZER_ONLY_FILE), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _TOKENIZER_ONLY_FILE


def _write_tokenizer(out: Path, ckpt, config: dict) -> None:
    # transformers prints progress and warnings; keep stdout clean for `python -m vllm_metal.models`.
    with contextlib.redirect_stdout(sys.stderr):
        from transformers import AutoTokenizer

        source = _tokenizer_source(out, ckpt)
        tok = AutoTokenizer.from_pretrained(str(out), gguf_file=source)
        if source != GGUF_FILE_IN_DIR:
            (out / source).unlink()
        meta = ckpt.metadata
        for flag in ("add_bos_token", "add_eos_token"):
            value = meta.get(f"tokenizer.ggml.{flag}")
            if value is not None and hasattr(tok, flag) and getattr(tok, flag) != bool(value):
                setattr(tok, flag, bool(value))  # rebuilds the post-processor
        template = meta.get("tokenizer.chat_template")
        if not template and config["model_type"] == "gemma3_text":
            template = GEMMA_CHAT_TEMPLATE
        if template:
            tok.chat_template = template
        tok.save_pretrained(str(out))
    # Older readers take the template from tokenizer_config.json only.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    if template:
        tc["chat_template"] = template
    for flag in ("add_bos_token", "add_eos_token"):
        value = ckpt.metadata.get(f"tokenizer.ggml.{flag}")
        if value is not None:
            tc[flag] = bool(value)
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
