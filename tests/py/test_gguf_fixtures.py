"""GGUF fixtures for the gguf_* tests, built with the `gguf` package (the reference).

Other test_gguf_* modules import the builders from here; the tests in this
module check the fixtures and the shared constant tables themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES

ROOT = Path(__file__).resolve().parents[2]

# Every supported type, in the order.
SUPPORTED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
             T.IQ4_NL, T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.MXFP4, T.F32, T.F16, T.BF16]
UNSUPPORTED = [T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.TQ1_0, T.TQ2_0]

# Types the gguf package quantizes (real quantizer output); the rest get random
# valid blocks: random bytes with sane float16 scales at these byte offsets.
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.F32, T.F16, T.BF16}
SCALE_OFFSETS = {
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ3_S: (0,), T.IQ3_XXS: (0,),
}


def block_size(t: T) -> int:
    return GGML_QUANT_SIZES[t][0]


def row_multiple(t: T) -> int:
    """Smallest legal row length (K) of a type."""
    return block_size(t)


def random_blocks(t: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid blocks of type t for a [rows, cols] tensor."""
    rng = np.random.default_rng(seed)
    if t in QUANTIZABLE:
        w = (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)
        q = quants.quantize(w, t)
        return np.ascontiguousarray(q).view(np.uint8).reshape(rows, -1)
    bs, ts = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    for off in SCALE_OFFSETS[t]:
        mag = rng.uniform(1e-3, 5e-2, size=(rows, cols // bs)).astype(np.float16)
        sign = rng.choice([-1, 1], size=mag.shape).astype(np.float16)
        raw[:, :, off:off + 2] = (mag * sign).view(np.uint8).reshape(rows, cols // bs, 2)
    return raw.reshape(rows, -1)


def reference_dequantize(blocks: np.ndarray, t: T, shape) -> np.ndarray:
    """The gguf package's float32 dequantization."""
    raw = np.ascontiguousarray(blocks).reshape(-1).view(np.uint8)
    if t == T.F32:
        raw = raw.view(np.float32)
    elif t == T.F16:
        raw = raw.view(np.float16)
    out = quants.dequantize(raw, t)
    return np.asarray(out, dtype=np.float32).reshape(shape)


def write_gguf(path: Path, tensors: dict, metadata: dict | None = None, arch: str = "llama",
               alignment: int | None = None) -> Path:
    """Writes a GGUF v3 file: tensors = {name: (type, shape, uint8 blocks)}."""
    w = GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value in (metadata or {}).items():
        if isinstance(value, tuple):  # (value, GGUFValueType)
            w.add_key_value(key, value[0], value[1])
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_int64(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    for name, (t, shape, blocks) in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(blocks).view(np.uint8).reshape(shape[0], -1)
                     if len(shape) == 2 else blocks.view(np.uint8).reshape(-1), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- tests of the fixtures and the shared tables ------------------------------------


def _header_table(name: str) -> np.ndarray:
    text = (ROOT / "src/metal/gguf_tables.h").read_text()
    body = re.search(name + r"\[\d+\] = \{(.*?)\};", text, re.S).group(1)
    return np.array([int(v, 0) for v in re.findall(r"-?0x[0-9a-f]+|-?\d+", body)], dtype=np.int64)


def test_iq_tables_match_the_reference():
    assert list(_header_table("kGgufIq4nlValues")) == list(quants.IQ4_NL.kvalues)
    assert list(_header_table("kGgufMxfp4Values")) == list(quants.MXFP4.kvalues)
    for cls, name in [(quants.IQ3_XXS, "kGgufIq3xxsGrid"), (quants.IQ3_S, "kGgufIq3sGrid")]:
        cls.init_grid()
        g = cls.grid.reshape(-1, 4).astype(np.int64)
        packed = g[:, 0] | (g[:, 1] << 8) | (g[:, 2] << 16) | (g[:, 3] << 24)
        np.testing.assert_array_equal(_header_table(name), packed)


def test_random_blocks_dequantize_to_finite_values():
    for t in SUPPORTED:
        cols = 2 * max(32, block_size(t))
        b = random_blocks(t, 3, cols, seed=1)
        w = reference_dequantize(b, t, (3, cols))
        assert np.isfinite(w).all() and np.abs(w).max() > 0, t.name
