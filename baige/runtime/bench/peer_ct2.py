"""CTranslate2 as a peer of ``baige bench compare`` (:mod:`baige.runtime.bench.peers`).

Conversion: CTranslate2's transformers converter (``ct2-transformers-converter``'s
``TransformersConverter``) with ``quantization="int8"``: int8 weights, one scale per output row. The
formats are compute types of that one conversion: ``int8`` (CTranslate2 resolves it to int8 weights and
float32 elsewhere on CPU) and ``int8_float32`` (the same, named explicitly). Timing: ``Generator`` with
``intra_threads`` = the run's threads and one worker (``inter_threads=1``); greedy (``sampling_topk=1``),
exactly the asked tokens (``min_length = max_length``). Batched generation: ``generate_batch`` over
``batch_size`` prompts at a time with one ``max_length`` (the longest asked; only the asked tokens count,
as HF's static batching). Tokens are passed as the vocabulary's strings (``vocabulary.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from baige.runtime.bench.peers import converted, tree_bytes

REQUIRES = ("ctranslate2", "transformers")
FORMATS = ("int8", "int8_float32")


def formats(variants: tuple[str, ...]) -> tuple[str, ...]:
    """CTranslate2 has no int4 CPU path: its int8 rows, whatever baige's variants."""
    return FORMATS


def _convert(model_dir: Path, out: Path) -> None:
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(model_dir), low_cpu_mem_usage=True).convert(str(out), quantization="int8", force=True)


class Runner:
    def __init__(self, path: Path, fmt: str, threads: int) -> None:
        import ctranslate2

        self.gen = ctranslate2.Generator(
            str(path), device="cpu", compute_type=fmt, intra_threads=threads, inter_threads=1
        )
        self.vocab = json.loads((path / "vocabulary.json").read_text())
        self.weight_bytes = tree_bytes(path, (".bin",))
        self.kv_bytes = 4  # float32 activations and cache on CPU
        self.settings = f"compute_type {self.gen.compute_type}, intra_threads {threads}, inter_threads 1"

    def _tokens(self, ids: list[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def _generate(self, prompts: list[list[int]], n: int, batch_size: int) -> None:
        self.gen.generate_batch(
            [self._tokens(p) for p in prompts],
            max_batch_size=batch_size,
            max_length=n,
            min_length=n,
            sampling_topk=1,
            include_prompt_in_result=False,
        )

    def decode(self, prompt: list[int], n: int) -> None:
        self._generate([prompt], n, 1)

    def prefill(self, prompt: list[int]) -> None:
        self._generate([prompt], 1, 1)

    def batch(self, requests: list[tuple[list[int], int]], batch_size: int) -> None:
        for i in range(0, len(requests), batch_size):
            chunk = requests[i : i + batch_size]
            self._generate([p for p, _ in chunk], max(n for _, n in chunk), batch_size)


def open_row(model_dir: Path, fmt: str, cache: Path, threads: int, options: dict) -> Runner:
    """The int8 conversion of ``model_dir`` (cached) loaded with compute type ``fmt``."""
    path = converted(cache, "ctranslate2", model_dir, "int8", lambda out: _convert(model_dir, out))
    return Runner(path, fmt, threads)
