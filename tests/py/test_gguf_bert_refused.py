"""A BERT GGUF (llama.cpp architecture "bert") is not served yet: preparing it says so
by name instead of failing later."""

from __future__ import annotations

import pytest


def test_bert_gguf_is_refused_with_a_message(tmp_path):
    import gguf

    from vllm_metal.models import prepare_gguf_dir

    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_pooling_type(gguf.PoolingType.CLS)
    w.add_tensor("token_embd.weight", gguf.np.zeros((4, 8), dtype=gguf.np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'bert' is not supported"):
        prepare_gguf_dir(str(path), str(tmp_path / "dir"))
