"""The GGUF reader: files written by the gguf package parse to the same values,
and every malformed variant fails with an error naming the problem."""

import struct

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType

from test_gguf_fixtures import random_blocks, write_gguf
from vllm_metal import _core, ops

GGUFFile = _core.GGUFFile


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "sample.gguf"
    tensors = {
        "tok_embd.weight": (T.Q8_0, (5, 64), random_blocks(T.Q8_0, 5, 64, seed=1)),
        "blk.0.attn_q.weight": (T.Q4_K, (3, 256), random_blocks(T.Q4_K, 3, 256, seed=2)),
        "output_norm.weight": (T.F32, (1, 7), random_blocks(T.F32, 1, 7, seed=3)),
        "blk.0.ffn_up.weight": (T.BF16, (2, 9), random_blocks(T.BF16, 2, 9, seed=4)),
    }
    meta = {
        "test.u8": (200, GGUFValueType.UINT8),
        "test.i8": (-5, GGUFValueType.INT8),
        "test.u16": (60000, GGUFValueType.UINT16),
        "test.i16": (-30000, GGUFValueType.INT16),
        "test.u32": (4000000000, GGUFValueType.UINT32),
        "test.i32": (-2000000000, GGUFValueType.INT32),
        "test.f32": (1.5, GGUFValueType.FLOAT32),
        "test.bool": (True, GGUFValueType.BOOL),
        "test.string": ("héllo", GGUFValueType.STRING),
        "test.u64": (2**63 + 5, GGUFValueType.UINT64),
        "test.i64": (-(2**40), GGUFValueType.INT64),
        "test.f64": (0.1, GGUFValueType.FLOAT64),
        "test.tokens": ["<s>", "a", "", "ü"],
        "test.scores": [0.5, -1.25],
        "test.types": [1, 2, 3],
    }
    write_gguf(path, tensors, meta, alignment=64)
    return path, tensors, meta


def test_metadata_and_tensors_round_trip(sample):
    path, tensors, meta = sample
    f = GGUFFile.open(str(path))
    assert f.version == 3 and f.alignment == 64 and f.data_offset % 64 == 0
    md = f.metadata
    assert md["general.architecture"] == "llama"
    for key, value in meta.items():
        want = value[0] if isinstance(value, tuple) else value
        if isinstance(want, float):
            assert md[key] == pytest.approx(want, rel=1e-6), key
        else:
            assert md[key] == want, key
    assert f.metadata_type("test.u16") == "u16"
    assert f.metadata_type("test.tokens") == "array[string]"
    ref = GGUFReader(str(path))
    assert [t.name for t in f.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(f.tensors, ref.tensors):
        assert t.type == int(r.tensor_type) and t.ne == [int(v) for v in r.shape]
        assert t.offset + f.data_offset == r.data_offset and t.nbytes == r.n_bytes
        data = np.array(f.tensor_data(t.name))
        assert data.shape[0] * data.shape[1] == t.nbytes
        np.testing.assert_array_equal(data.reshape(-1), np.asarray(r.data).view(np.uint8).reshape(-1))
        assert tuple(t.shape) == tuple(tensors[t.name][1])


def test_tensor_data_feeds_the_ops_and_outlives_the_file(sample):
    path, tensors, _ = sample
    f = GGUFFile.open(str(path))
    blocks = f.tensor_data("blk.0.attn_q.weight")
    del f  # the array keeps the mapping alive
    w = ops.gguf_dequantize(blocks, "Q4_K", [3, 256])
    from test_gguf_fixtures import reference_dequantize
    np.testing.assert_array_equal(np.array(w), reference_dequantize(tensors["blk.0.attn_q.weight"][2], T.Q4_K, (3, 256)))


# ---- malformed files: a tiny hand-written encoder -------------------------------------


def s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def kv(key: bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def tinfo(name: bytes, dims, ttype: int, offset: int) -> bytes:
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<II", ttype, 0)[:4] + struct.pack("<Q", offset)


def build(kvs=(), tensors=(), data=b"", version=3, n_tensors=None, n_kv=None, align=32):
    head = b"GGUF" + struct.pack("<I", version)
    head += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors,
                        len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    pad = (-len(body)) % align
    return body + b"\0" * pad + data


GOOD = build([kv(b"general.architecture", 8, s(b"llama"))],
             [tinfo(b"w", [32, 2], 2, 0), tinfo(b"b", [4], 0, 64)], b"\1" * 36 + b"\0" * 28 + b"\2" * 16)


def test_hand_written_file_parses():
    assert GGUFFile.parse_bytes(GOOD) == 2


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", r"file is truncated"),
        (b"GGUX" + GOOD[4:], r"not a GGUF file \(bad magic\)"),
        (build(version=1), r"GGUF version 1 is not supported"),
        (build(version=0x03000000), r"big-endian GGUF files are not supported"),
        (build(version=4), r"unsupported GGUF version 4"),
        (build(n_kv=10**12), r"metadata count 1000000000000 does not fit in the file"),
        (build(n_tensors=10**12), r"tensor count 1000000000000 does not fit in the file"),
        (build([kv(b"a", 13, b"")]), r"metadata 'a' has unknown value type 13"),
        (build([kv(b"a", 8, struct.pack("<Q", 1000) + b"xy")]), r"truncated: metadata string needs 1000 bytes"),
        (build([kv(b"a", 9, struct.pack("<IQ", 4, 2**61))]), r"array of 2305843009213693952 u32 does not fit"),
        (build([kv(b"a", 9, struct.pack("<IQ", 8, 2**60))]), r"array of 1152921504606846976 strings does not fit"),
        (build([kv(b"a", 9, struct.pack("<IQ", 9, 1))]), r"metadata 'a' is an array of arrays"),
        (build([kv(b"a", 7, b"\x02")]), r"bool value must be 0 or 1, got 2"),
        (build([kv(b"a", 4, b"\0" * 4), kv(b"a", 4, b"\0" * 4)]), r"duplicate metadata key 'a'"),
        (build([kv(b"", 4, b"\0" * 4)]), r"metadata key 0 is empty"),
        (build([kv(b"a\x9f", 4, b"\0" * 4)]), r"metadata key 0 is not valid UTF-8"),
        (build([], [tinfo(b"\xc0\x80", [32], 2, 0)], b"\0" * 32), r"tensor 0 name is not valid UTF-8"),
        (build([kv(b"general.alignment", 4, struct.pack("<I", 48))]), r"general.alignment must be a power of two, got 48"),
        (build([kv(b"general.alignment", 5, struct.pack("<i", 32))]), r"general.alignment must be u32, got i32"),
        (build([], [tinfo(b"w", [32, 1, 1, 1, 1], 2, 0)]), r"tensor 'w' has 5 dimensions \(need 1 to 4\)"),
        (build([], [tinfo(b"w", [], 2, 0)]), r"tensor 'w' has 0 dimensions"),
        (build([], [tinfo(b"w", [2**62, 4], 0, 0)]), r"tensor 'w' has too many elements"),
        (build([], [tinfo(b"w", [32], 99, 0)]), r"tensor 'w' has unknown type id 99"),
        (build([], [tinfo(b"w", [256], 16, 0)]), r"tensor 'w' has type IQ2_XXS, which is not supported \(supported: F32"),
        (build([], [tinfo(b"w", [33], 2, 0)]), r"first dimension 33 is not a multiple of the block size 32"),
        (build([], [tinfo(b"w", [32], 2, 8)], b"\0" * 64), r"tensor 'w' offset 8 is not a multiple of the alignment 32"),
        (build([], [tinfo(b"w", [32], 2, 0), tinfo(b"w", [32], 2, 32)], b"\0" * 64), r"duplicate tensor name 'w'"),
        (build([], [tinfo(b"w", [32], 2, 0)], b"\0" * 17), r"file is truncated: tensor 'w' needs bytes"),
        (build([], [tinfo(b"w", [32], 2, 2**63)], b"\0" * 32), r"file is truncated: tensor 'w'"),
        (build([], [tinfo(b"w", [64], 2, 0), tinfo(b"v", [32], 2, 32)], b"\0" * 96), r"tensors 'w' and 'v' overlap"),
        (build([], [tinfo(b"", [32], 2, 0)], b"\0" * 32), r"tensor 0 has an empty name"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None,
)
def test_malformed_files_raise_a_named_error(data, message):
    with pytest.raises(ValueError, match=message):
        GGUFFile.parse_bytes(data)


def test_every_truncation_of_a_valid_file_is_an_error():
    for n in range(len(GOOD)):
        with pytest.raises(ValueError, match=r"\[gguf\]"):
            GGUFFile.parse_bytes(GOOD[:n])


def test_unsupported_types_can_be_inspected_when_asked():
    data = build([], [tinfo(b"w", [256], 16, 0)], b"\0" * 66)
    assert GGUFFile.parse_bytes(data, require_supported_types=False) == 1


def test_open_reports_missing_and_truncated_files(tmp_path):
    with pytest.raises(ValueError, match=r"cannot open .*nope.gguf"):
        GGUFFile.open(str(tmp_path / "nope.gguf"))
    (tmp_path / "short.gguf").write_bytes(b"GGUF\3\0\0\0")
    with pytest.raises(ValueError, match=r"smaller than a GGUF header"):
        GGUFFile.open(str(tmp_path / "short.gguf"))
    (tmp_path / "cut.gguf").write_bytes(GOOD[:-5])
    with pytest.raises(ValueError, match=r"truncated: tensor 'b'"):
        GGUFFile.open(str(tmp_path / "cut.gguf"))


def test_missing_keys_and_tensors(sample):
    f = GGUFFile.open(str(sample[0]))
    with pytest.raises(ValueError, match=r"no metadata key 'nope'"):
        f.metadata_type("nope")
    with pytest.raises(ValueError, match=r"no tensor 'nope'"):
        f.tensor("nope")
