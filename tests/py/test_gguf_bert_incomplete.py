"""A BERT GGUF (llama.cpp architecture "bert") missing the tensors an encoder needs is
refused by name when its directory is prepared, not later in the engine."""

from __future__ import annotations

import pytest


def test_incomplete_bert_gguf_is_refused_with_a_message(tmp_path):
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
    with pytest.raises(ValueError, match="'bert' GGUF without position_embd.weight"):
        prepare_gguf_dir(str(path), str(tmp_path / "dir"))


def test_bert_reranker_gguf_without_its_head_is_refused_with_a_message(tmp_path):
    # pooling_type RANK is served as BertForSequenceClassification: cls and cls.output needed
    import gguf

    from vllm_metal.models import prepare_gguf_dir

    path = tmp_path / "rank.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_feed_forward_length(16)
    w.add_pooling_type(gguf.PoolingType.RANK)
    zeros = gguf.np.zeros
    for name, shape in (("token_embd.weight", (4, 8)), ("position_embd.weight", (16, 8)),
                        ("token_embd_norm.weight", (8,)), ("token_embd_norm.bias", (8,)),
                        ("cls.weight", (8, 8)), ("cls.bias", (8,))):
        w.add_tensor(name, zeros(shape, dtype=gguf.np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"reranker GGUF \(pooling_type RANK\) without "
                                         r"cls.output.weight, cls.output.bias"):
        prepare_gguf_dir(str(path), str(tmp_path / "dir"))
