"""Checkpoints on disk: model spec resolution (``hub``: local dir, .gguf, alias, HF repo id), safetensors
read/write with the one atomic HF-directory writer (``safetensors_io``), strict loading into the
Transformer (``loader``), GGUF import (``gguf_import``, ``gguf_tokenizer``) and ``baige convert`` (``convert``)."""
