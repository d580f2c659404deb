"""The encoder architectures (bidirectional, no KV cache, --runner pooling only); a module
of its own so the platform can name them without importing MLX."""

# models/bert.py
BERT_ARCHITECTURES = frozenset({
    "BertModel", "BertForMaskedLM", "BertForSequenceClassification",
    "XLMRobertaModel", "XLMRobertaForSequenceClassification", "RobertaModel",
    "RobertaForSequenceClassification",
})
# models/gemma3_encoder.py: EmbeddingGemma (Gemma 3 text with bidirectional attention)
GEMMA3_ENCODER_ARCHITECTURES = frozenset({"Gemma3TextModel"})

ENCODER_ARCHITECTURES = BERT_ARCHITECTURES | GEMMA3_ENCODER_ARCHITECTURES
