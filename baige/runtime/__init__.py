"""The model runtime: config, model, loading, tokenization, sampling and generation."""
