"""apply_token_bitmask against a NumPy reference written from xgrammar's documented rule
(bit t % 32 of word t // 32, 0 = disallowed -> -inf), bit for bit, on every backend; the
kernel's launches on NumPy (out of place and in place, guard values around the output);
xgrammar's own CPU kernel as a second oracle; the errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, bits, random
from vllm_metal import _core, emulation, ops

NEG_INF_BITS = {"float32": 0xFF800000, "float16": 0xFC00, "bfloat16": 0xFF80}
BITS_DTYPE = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}


def make_mask(kind: str, num_masked: int, words: int, seed: int) -> np.ndarray:
    """int32 [num_masked, words]: 'ones' all allowed, 'zeros' none, 'random' half,
    'sparse' a grammar-like mask (about 1 token in 200 allowed, some words all ones)."""
    rng = np.random.default_rng(seed)
    if kind == "ones":
        return np.full((num_masked, words), -1, np.int32)
    if kind == "zeros":
        return np.zeros((num_masked, words), np.int32)
    u = rng.integers(0, 2**32, size=(num_masked, words), dtype=np.uint64).astype(np.uint32)
    if kind == "sparse":
        allowed = rng.random((num_masked, words, 32)) < 0.005
        u = (allowed.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
        u[:, rng.integers(0, words, size=2)] = 0xFFFFFFFF
    return u.view(np.int32)


def allowed_of(mask: np.ndarray, vocab: int) -> np.ndarray:
    """bool [num_masked, vocab]: token t allowed iff bit t % 32 of word t // 32 is set."""
    t = np.arange(vocab)
    words = mask.view(np.uint32)[:, t // 32]
    return ((words >> (t % 32).astype(np.uint32)) & 1).astype(bool)


def reference_bits(logit_bits: np.ndarray, mask: np.ndarray, rows, dtype: str) -> np.ndarray:
    out = logit_bits.copy()
    allowed = allowed_of(mask, logit_bits.shape[1])
    for i, r in enumerate(rows):
        out[r, ~allowed[i]] = NEG_INF_BITS[dtype]
    return out


def case_id(num_rows, vocab, words, rows, kind, dtype):
    return (f"apply_token_bitmask(rows={num_rows},vocab={vocab},words={words},"
            f"masked={list(rows)},{kind},dt={dtype})")


# (num_rows, vocab, extra mask words, masked rows): one token, vocab not a multiple of 32,
# one span of 1024 +-1, threadgroup span 8192 +1, a wider mask, rows in any order
SHAPES = [
    (1, 1, 0, [0]),
    (3, 100, 0, [2, 0]),
    (4, 1000, 3, [3, 1, 0]),
    (2, 1023, 0, [1]),
    (2, 1024, 0, [0, 1]),
    (3, 1025, 1, [2]),
    (2, 8193, 0, [1, 0]),
    (5, 49152, 0, [4, 1, 2]),  # SmolLM2's vocab
]
KINDS = ["random", "sparse", "zeros", "ones"]


def run_case(num_rows, vocab, extra, rows, kind, dtype, seed=0):
    words = (vocab + 31) // 32 + extra
    logits = random((num_rows, vocab), dtype, seed=seed + vocab, scale=4.0)
    mask = make_mask(kind, len(rows), words, seed=seed + num_rows)
    out = ops.apply_token_bitmask(logits, mx.array(mask), mx.array(np.array(rows, np.int32)))
    assert out.dtype == logits.dtype and out.shape == logits.shape
    expect = reference_bits(bits(logits), mask, rows, dtype)
    got = bits(out)
    differ = np.argwhere(got != expect)
    assert differ.size == 0, (f"{case_id(num_rows, vocab, words, rows, kind, dtype)}: "
                              f"{len(differ)} values differ, first at {differ[:3].tolist()}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}+{s[2]}w")
def test_matches_reference(backend, shape, kind, dtype):
    run_case(*shape, kind, dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gemma3_vocab(backend, dtype):
    # 262144 tokens: 32 threadgroups per row
    run_case(3, 262144, 0, [2, 0], "sparse", dtype, seed=3)


def test_mask_allowing_nothing_gives_an_all_inf_row(backend):
    logits = random((2, 70), "float32", seed=1)
    out = np.array(ops.apply_token_bitmask(logits, mx.zeros((1, 3), mx.int32), mx.array([1], mx.int32)))
    assert np.all(out[1] == -np.inf)
    assert np.array_equal(out[0], np.array(logits[0]))


def test_bits_past_the_vocab_are_ignored(backend):
    # the last word's high bits and whole extra words: set or clear, the same result
    logits = random((2, 40), "bfloat16", seed=2)
    rows = mx.array([0, 1], mx.int32)
    mask = make_mask("random", 2, 4, seed=3)
    cleared = mask.copy().view(np.uint32)
    cleared[:, 1] &= 0xFF
    cleared[:, 2:] = 0
    a = ops.apply_token_bitmask(logits, mx.array(mask), rows)
    b = ops.apply_token_bitmask(logits, mx.array(cleared.view(np.int32)), rows)
    assert np.array_equal(bits(a), bits(b))


def test_values_are_copied_bit_for_bit(backend):
    # NaN payloads, -0.0, infinities and subnormals pass untouched where allowed
    raw = np.array([[0x7FC01234, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x3F800000]],
                   np.uint32)
    logits = mx.array(raw.view(np.float32))
    out = ops.apply_token_bitmask(logits, mx.array([[0b011111]], mx.int32), mx.array([0], mx.int32))
    expect = raw.copy()
    expect[0, 5] = NEG_INF_BITS["float32"]
    assert np.array_equal(bits(out), expect)


def test_empty_row_list_returns_the_logits(backend):
    logits = random((3, 64), "float16", seed=4)
    out = ops.apply_token_bitmask(logits, mx.zeros((0, 2), mx.int32), mx.zeros((0,), mx.int32))
    assert np.array_equal(bits(out), bits(logits))
    out = ops.apply_token_bitmask(mx.zeros((0, 64)), mx.zeros((0, 2), mx.int32), mx.zeros((0,), mx.int32))
    assert out.shape == (0, 64)


def test_lazy_inputs_and_strided_views(backend):
    # a logits view with a row stride (a slice), a transposed mask: both made dense first
    base = random((4, 200), "float32", seed=5)
    logits = base[1:, :100] * 2.0
    mask = make_mask("random", 2, 4, seed=6)
    rows = [2, 0]
    out = ops.apply_token_bitmask(logits, mx.array(np.ascontiguousarray(mask.T)).T,
                                  mx.array(np.array(rows, np.int32)))
    assert np.array_equal(bits(out), reference_bits(bits(logits), mask, rows, "float32"))


def test_a_donated_logits_buffer_is_masked_in_place(backend):
    # logits that nothing else holds (a lazy product here, the lm head's output when
    # serving) lend their buffer to the output: the kernels then write only the -infs.
    # Peak memory shows it: one [rows, vocab] buffer, not two.
    if backend == "metal":
        pytest.skip("peak memory of the CPU allocator")
    x = random((8, 65536), "float32", seed=10)
    mask = make_mask("random", 2, 2048, seed=11)
    rows = [5, 2]
    mx.eval(x)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = ops.apply_token_bitmask(x * 2.0, mx.array(mask), mx.array(np.array(rows, np.int32)))
    mx.eval(out)
    assert mx.get_peak_memory() - base < 1.5 * x.nbytes, "the output did not take the logits' buffer"
    assert np.array_equal(bits(out), reference_bits(bits(x * 2.0), mask, rows, "float32"))


def test_agrees_with_xgrammar():
    # xgrammar's own CPU kernel: logits rows selected by `indices`, each with the bitmask row
    # of the same index (vLLM V1 scatters its compact masks into that layout first)
    torch = pytest.importorskip("torch")
    xgr = pytest.importorskip("xgrammar")
    num_rows, vocab = 5, 300
    words = (vocab + 31) // 32
    rows = [3, 0, 4]
    logits = random((num_rows, vocab), "float32", seed=7)
    mask = make_mask("random", len(rows), words, seed=8)
    sorted_mask = np.full((num_rows, words), -1, np.int32)
    sorted_mask[rows] = mask
    theirs = torch.from_numpy(np.array(logits).copy())
    xgr.apply_token_bitmask_inplace(theirs, torch.from_numpy(sorted_mask), indices=rows)
    ours = ops.apply_token_bitmask(logits, mx.array(mask), mx.array(np.array(rows, np.int32)))
    assert np.array_equal(np.array(ours), theirs.numpy())


def test_a_real_grammar_mask_allows_exactly_the_grammar_tokens(backend):
    # xgrammar fills the masks (regex ab(c|a)*, a 10-token vocab padded to 70 ids): a token
    # stays finite iff the matcher accepts it. xgrammar leaves the bits past vocab_size set
    # (word 2's high bits) and the padding ids' bits 0, so this also pins both conventions.
    pytest.importorskip("torch")
    xgr = pytest.importorskip("xgrammar")
    vocab = ["a", "b", "c", "ab", "ba", "abc", "x", "</s>", "cc", "aab"]
    info = xgr.TokenizerInfo(vocab, vocab_size=70, stop_token_ids=[7])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(r"ab(c|a)*"))
    mask = xgr.allocate_token_bitmask(2, info.vocab_size)  # torch int32 [2, 3]
    accepted = []
    for i, prefix in enumerate([[], [3]]):  # at the start; after "ab"
        for t in prefix:
            assert matcher.accept_token(t)
        matcher.fill_next_token_bitmask(mask, i)
        ok = []
        for t in range(len(vocab)):
            if matcher.accept_token(t):
                matcher.rollback(1)
                ok.append(t)
        accepted.append(ok)
    mask = mask.numpy()
    assert mask.view(np.uint32)[1, 2] >> 6 != 0, "xgrammar no longer sets the bits past vocab_size"
    logits = random((3, 70), "float32", seed=9)
    out = np.array(ops.apply_token_bitmask(logits, mx.array(mask), mx.array([2, 0], mx.int32)))
    assert np.flatnonzero(np.isfinite(out[2])).tolist() == accepted[0] == [0, 3, 5]
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == accepted[1] == [0, 2, 7, 8]
    assert np.array_equal(out[1], np.array(logits[1]))


def test_kernel_names_are_instantiated():
    names = {l.kernel for d in DTYPES for ip in (False, True)
             for l in _core.plan_apply_token_bitmask(d, 3, 1000, 32, in_place=ip)}
    assert names == {f"apply_token_bitmask_{d}" for d in DTYPES}
    assert names <= set(emulation.library("apply_token_bitmask").kernels)


def test_plan_geometry():
    # (vocab, threadgroups per row, threads): 8 simdgroups of 1024 tokens at most
    for vocab, spans, threads in [(1, 1, 32), (1024, 1, 32), (1025, 1, 64), (8192, 1, 256),
                                  (8193, 2, 256), (49152, 6, 256), (262144, 32, 256)]:
        (l,) = _core.plan_apply_token_bitmask("float16", 7, vocab, (vocab + 31) // 32 + 2)
        assert l.kernel == "apply_token_bitmask_float16"
        assert list(l.grid) == [spans, 7, 1] and list(l.threadgroup) == [threads, 1, 1]
        assert [(b.index, b.array_slot) for b in l.buffers] == [(0, 0), (1, 1), (2, 2), (3, 3)]
        assert l.args_index == 4 and len(l.args) == 32


GUARD = 64
SENTINEL = 0x5A5A


def mask_of_row(num_rows, rows):
    m = np.full(num_rows, -1, np.int32)
    m[rows] = np.arange(len(rows), dtype=np.int32)
    return m


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in_place"])
@pytest.mark.parametrize("num_rows, vocab, extra, rows", [(3, 45, 1, [2, 0]), (4, 1100, 0, [1, 2, 3]),
                                                          (2, 9000, 2, [1])])
def test_launches_on_numpy(num_rows, vocab, extra, rows, in_place):
    """The planner's launch on NumPy bits (float16), guard values around the output; in
    place, out is logits (one array for slots 0 and 3)."""
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32 + extra
    logit_bits = rng.integers(0, 0x7C00, size=(num_rows, vocab)).astype(np.uint16)
    mask = make_mask("random", len(rows), words, seed=num_rows)
    inverse = mask_of_row(num_rows, rows)
    backing = np.full(num_rows * vocab + 2 * GUARD, SENTINEL, np.uint16)
    out = backing[GUARD:GUARD + num_rows * vocab].reshape(num_rows, vocab)
    plan = _core.plan_apply_token_bitmask("float16", num_rows, vocab, words, in_place=in_place)
    if in_place:
        out[...] = logit_bits
        emulation.run_plan(plan, [out, mask, inverse, out])
    else:
        emulation.run_plan(plan, [logit_bits, mask, inverse, out])
    assert np.array_equal(out, reference_bits(logit_bits, mask, rows, "float16"))
    assert np.all(backing[:GUARD] == SENTINEL) and np.all(backing[-GUARD:] == SENTINEL), \
        "kernel wrote outside its output"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ops.apply_token_bitmask(mx.zeros((2, 4), mx.int32), mx.zeros((1, 1), mx.int32),
                                         mx.array([0], mx.int32)),
         r"\[apply_token_bitmask\] logits must be float32, float16 or bfloat16, got int32"),
        (lambda: ops.apply_token_bitmask(mx.zeros((4,)), mx.zeros((1, 1), mx.int32), mx.array([0], mx.int32)),
         r"\[apply_token_bitmask\] logits must be \[num_rows, vocab\], got \[4\]"),
        (lambda: ops.apply_token_bitmask(mx.zeros((2, 4)), mx.zeros((1, 1), mx.uint32), mx.array([0], mx.int32)),
         r"\[apply_token_bitmask\] bitmask must be int32, got uint32"),
        (lambda: ops.apply_token_bitmask(mx.zeros((2, 4)), mx.zeros((1,), mx.int32), mx.array([0], mx.int32)),
         r"\[apply_token_bitmask\] bitmask must be \[num_masked, words\], got \[1\]"),
        (lambda: ops.apply_token_bitmask(mx.zeros((2, 4)), mx.zeros((1, 1), mx.int32), mx.array([0], mx.int64)),
         r"\[apply_token_bitmask\] rows must be int32, got int64"),
        (lambda: ops.apply_token_bitmask(mx.zeros((2, 4)), mx.zeros((1, 1), mx.int32), mx.array([0.0])),
         r"\[apply_token_bitmask\] rows must be int32, got float32"),
        (lambda: ops.apply_token_bitmask(mx.zeros((2, 4)), mx.zeros((2, 1), mx.int32), mx.array([0], mx.int32)),
         r"\[apply_token_bitmask\] rows must be \[2\] \(one logits row per bitmask row\), got \[1\]"),
        (lambda: ops.apply_token_bitmask(mx.zeros((2, 65)), mx.zeros((1, 2), mx.int32), mx.array([0], mx.int32)),
         r"\[apply_token_bitmask\] bitmask rows of 2 words cover 64 tokens, fewer than the vocab "
         r"of 65 \(needs ceil\(65 / 32\) = 3 words\)"),
        (lambda: ops.apply_token_bitmask(mx.zeros((2, 4)), mx.zeros((1, 1), mx.int32), mx.array([2], mx.int32)),
         r"\[apply_token_bitmask\] rows\[0\] = 2 is out of range for logits of 2 rows"),
        (lambda: ops.apply_token_bitmask(mx.zeros((2, 4)), mx.zeros((1, 1), mx.int32), mx.array([-1], mx.int32)),
         r"\[apply_token_bitmask\] rows\[0\] = -1 is out of range for logits of 2 rows"),
        (lambda: ops.apply_token_bitmask(mx.zeros((3, 4)), mx.zeros((3, 1), mx.int32), mx.array([1, 0, 1], mx.int32)),
         r"\[apply_token_bitmask\] row 1 is listed twice \(rows\[0\] and rows\[2\]\)"),
    ],
)
def test_bad_input_raises_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()
