"""baige: train, serve, quantize and benchmark Llama-family LLMs from Hugging Face checkpoints."""

__version__ = "0.1.0"
