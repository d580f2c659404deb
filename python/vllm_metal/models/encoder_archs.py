"""The BERT-family architectures models/bert.py loads; a module of its own so the
platform can name them without importing MLX."""

ENCODER_ARCHITECTURES = frozenset({
    "BertModel", "BertForMaskedLM", "BertForSequenceClassification",
    "XLMRobertaModel", "XLMRobertaForSequenceClassification", "RobertaModel",
    "RobertaForSequenceClassification",
})
