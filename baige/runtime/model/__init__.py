"""The model: :class:`~.config.ModelConfig` read from config.json, the one decoder
(:class:`~.transformer.Transformer`, dense Llama-family blocks), rotary embeddings (``rope``), the
tokenizer and chat template (``tokenizer``), and ``--dtype``/``--device`` resolution (``device``).
Imports only :mod:`baige.kernels`; never the engine, the trainer or the server."""
