"""baige: train, serve, quantize and benchmark Llama-family LLMs from Hugging Face checkpoints."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "LoRARequest", "BaigeError"]


def __getattr__(name: str):
    # Lazy: `import baige` stays light (no torch) until the offline API is used.
    if name == "LLM":
        from baige.runtime.infer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from baige.runtime.infer.sampling import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from baige.runtime.infer.lora import LoRARequest

        return LoRARequest
    if name == "BaigeError":
        from baige.errors import BaigeError

        return BaigeError
    raise AttributeError(f"module 'baige' has no attribute {name!r}")
