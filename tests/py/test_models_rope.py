"""apply_rope (ops.rope at per-token positions) against mlx-lm's own rope
modules, which the fallback path calls with one offset per token."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm.models.rope_utils import initialize_rope

from vllm_metal.models.rope import RopeConfig, apply_rope, rope_config, rope_fallback

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
}


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_ops_rope_matches_mlx_lm_module_at_packed_positions(kind, traditional):
    head_dim, base = 32, 10000.0
    module = initialize_rope(head_dim, base, traditional, SCALINGS[kind], 4096)
    cfg = rope_config(module, base, SCALINGS[kind])
    assert cfg.fallback is None  # all four run on our kernel
    rng = np.random.default_rng(0)
    positions = mx.array(np.concatenate([[0, 1, 2], rng.integers(0, 300, 13)]).astype(np.int32))
    x = mx.array(rng.standard_normal((16, 3, head_dim)).astype(np.float32))
    got = apply_rope(x, positions, cfg)
    want = rope_fallback(x, positions, RopeConfig(head_dim, not traditional, base, None, module))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=5e-5)


def test_other_ropes_use_the_mlx_lm_module_per_token():
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 64,
               "short_factor": [1.0] * 8, "long_factor": [1.0 + i / 4 for i in range(8)]}
    module = initialize_rope(16, 10000.0, False, scaling, 256)
    cfg = rope_config(module, 10000.0, scaling)
    assert cfg.fallback is module
    x = mx.array(np.random.default_rng(1).standard_normal((3, 2, 16)).astype(np.float32))
    positions = mx.array(np.array([4, 0, 9], np.int32))
    got = apply_rope(x, positions, cfg)
    for t in range(3):  # each row as its own sequence at its own offset
        want = module(x[t:t + 1].reshape(1, 2, 1, 16), offset=int(positions[t].item()))
        np.testing.assert_allclose(np.array(got[t]), np.array(want.reshape(2, 16)), atol=1e-6)


def test_rope_that_needs_whole_sequences_is_refused():
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="dynamic"):
        rope_config(initialize_rope(16, 10000.0, False, scaling, 128), 10000.0, scaling)
