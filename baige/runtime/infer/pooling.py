"""Pooling models (vLLM's ``--runner pooling``): which checkpoints are embedding models, how their hidden
states are pooled (:class:`PoolerConfig`, from the sentence-transformers files when present), a request's
:class:`PoolingParams`, and :class:`PoolingState`, a sequence's pooled hidden state as its prefill chunks run.

A pooling request is a prefill-only sequence in the one engine: the scheduler chunks and batches it with
the others, the runner returns the final hidden states (after the model's last norm, as transformers'
``AutoModel`` ``last_hidden_state``) of the rows its pooling needs instead of sampling, and the sequence
finishes when its prompt has been computed. Pooling types (vLLM's names):

- ``LAST``: the last prompt token's hidden state (vLLM's default for decoder models);
- ``MEAN``: the mean over every prompt token (sentence-transformers' ``pooling_mode_mean_tokens``);
- ``CLS``: the first token's.

The vector is then cut to the request's ``dimensions`` (Matryoshka truncation) and L2-normalised when the
model normalises (a sentence-transformers ``Normalize`` module, or no sentence-transformers files at all:
vLLM's default), in that order, as vLLM's embedding head does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from baige.errors import BaigeError

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config keys -> our pooling type (the modes baige implements)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULES = ("Transformer", "Pooling", "Normalize")  # sentence-transformers module types baige runs


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns hidden states into an embedding (vLLM's ``PoolerConfig`` fields).

    Attributes:
        pooling_type: ``LAST``, ``MEAN`` or ``CLS``.
        normalize: L2-normalise the pooled vector (after any Matryoshka truncation).
        is_matryoshka: any ``dimensions`` from 1 to the hidden size may be asked for (config.json's
            ``is_matryoshka``, vLLM's flag).
        matryoshka_dimensions: the only ``dimensions`` allowed, when config.json lists them.
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None


def _read(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BaigeError(f"{path}: cannot read it as JSON ({e})") from None


def is_pooling_model(model_dir: Path, config: dict) -> bool:
    """Whether ``--runner auto`` serves the checkpoint as a pooling model: it has sentence-transformers
    files (``modules.json`` or ``1_Pooling/config.json``), or its architecture is a bare decoder
    (``LlamaModel``, ``Qwen3Model``, ...: no language-model head) or names itself an embedding model."""
    if (model_dir / "modules.json").is_file() or (model_dir / "1_Pooling" / "config.json").is_file():
        return True
    arch = (config.get("architectures") or [""])[0]
    return isinstance(arch, str) and (
        (arch.endswith("Model") and not arch.endswith("PreTrainedModel")) or "Embedding" in arch
    )


def pooling_runner(runner: str, model_dir: str | Path) -> PoolerConfig | None:
    """The :class:`PoolerConfig` the engine runs ``model_dir`` with, or None for the generate runner:
    ``runner`` ``pooling``, or ``auto`` and :func:`is_pooling_model`. Raises BaigeError (an unknown
    runner; as :func:`pooler_config`)."""
    if runner not in RUNNERS:
        raise BaigeError(f"--runner {runner!r}: expected one of {', '.join(RUNNERS)}")
    model_dir = Path(model_dir)
    config = _read(model_dir / "config.json")
    if not isinstance(config, dict):
        raise BaigeError(f"{model_dir / 'config.json'}: expected a JSON object")
    if runner == "generate" or (runner == "auto" and not is_pooling_model(model_dir, config)):
        return None
    return pooler_config(model_dir, config)


def _pooling_dir(model_dir: Path) -> tuple[Path | None, bool | None]:
    """The sentence-transformers Pooling module's directory and whether a Normalize module follows it
    (None: no ``modules.json``). Raises BaigeError for a module baige cannot run (``Dense``, ...)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        found = model_dir / "1_Pooling"
        return (found if (found / "config.json").is_file() else None), None
    modules = _read(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise BaigeError(f"{modules_file}: expected a list of module objects")
    pooling, normalize = None, False
    for m in modules:
        kind = str(m.get("type", "")).rpartition(".")[2]
        if kind not in _ST_MODULES:
            raise BaigeError(
                f"{modules_file}: sentence-transformers module {m.get('type')!r} is not supported "
                f"(supported: {', '.join(_ST_MODULES)})"
            )
        if kind == "Pooling":
            pooling = model_dir / str(m.get("path", ""))
        normalize = normalize or kind == "Normalize"
    return pooling, normalize


def pooler_config(model_dir: str | Path, config: dict) -> PoolerConfig:
    """The :class:`PoolerConfig` of a checkpoint served by the pooling runner: the pooling mode of its
    sentence-transformers Pooling module (``modules.json`` -> its path's ``config.json``, or
    ``1_Pooling/config.json``), normalisation when ``modules.json`` lists a ``Normalize`` module (with
    no ``modules.json``: normalised, vLLM's default), and config.json's Matryoshka fields.

    Raises:
        BaigeError: unreadable files, a module or pooling mode baige does not implement, several modes
        at once, or bad Matryoshka fields.
    """
    model_dir = Path(model_dir)
    pooling_dir, normalize = _pooling_dir(model_dir)
    pooling_type = "LAST"
    if pooling_dir is not None:
        st = _read(pooling_dir / "config.json")
        if not isinstance(st, dict):
            raise BaigeError(f"{pooling_dir / 'config.json'}: expected a JSON object")
        bad = [k for k in _ST_UNSUPPORTED if st.get(k)]
        if bad:
            raise BaigeError(f"{pooling_dir / 'config.json'}: {bad[0]} is not supported (LAST, MEAN or CLS pooling)")
        modes = [t for k, t in _ST_MODES.items() if st.get(k)]
        if len(modes) != 1:
            raise BaigeError(
                f"{pooling_dir / 'config.json'}: exactly one of {', '.join(_ST_MODES)} must be true, got {len(modes)}"
            )
        pooling_type = modes[0]
    dims = config.get("matryoshka_dimensions")
    if dims is not None and (
        not isinstance(dims, list) or not dims or not all(isinstance(d, int) and d >= 1 for d in dims)
    ):
        raise BaigeError(f"{model_dir / 'config.json'}: matryoshka_dimensions must be a list of positive integers")
    return PoolerConfig(
        pooling_type=pooling_type,
        normalize=True if normalize is None else normalize,
        is_matryoshka=bool(config.get("is_matryoshka")) or dims is not None,
        matryoshka_dimensions=tuple(dims) if dims is not None else None,
    )


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's parameters (vLLM's ``PoolingParams``).

    Attributes:
        dimensions: keep the first this many components (Matryoshka truncation) before normalising;
            None: all ``hidden_size``.
        normalize: override the model's normalisation (None: the model's).
    """

    dimensions: int | None = None
    normalize: bool | None = None

    def check(self, pooler: PoolerConfig, hidden_size: int) -> None:
        """Raises BaigeError (param ``dimensions``) for dimensions the model does not allow: any, on a
        model that does not declare Matryoshka training (truncating its vectors would degrade them, so
        vLLM refuses too), one outside 1..hidden_size, or one not among ``matryoshka_dimensions``."""
        d = self.dimensions
        if d is None:
            return
        if not pooler.is_matryoshka:
            raise BaigeError(
                "dimensions: this model does not support Matryoshka representations (config.json declares "
                "neither is_matryoshka nor matryoshka_dimensions), so its output size cannot change",
                param="dimensions",
            )
        if not 1 <= d <= hidden_size:
            raise BaigeError(f"dimensions must be between 1 and {hidden_size}, got {d}", param="dimensions")
        if pooler.matryoshka_dimensions is not None and d not in pooler.matryoshka_dimensions:
            allowed = ", ".join(map(str, pooler.matryoshka_dimensions))
            raise BaigeError(f"dimensions {d} is not one this model supports ({allowed})", param="dimensions")


class PoolingState:
    """A pooling sequence's pooled hidden state, built as its prefill chunks run (``Sequence.pooling``).

    The runner asks :meth:`positions` which of a chunk's prompt positions it needs and hands their final
    hidden states to :meth:`add`; a chunk that starts at position 0 (the first, or the first again after a
    preemption recomputes the prompt) starts the sum afresh.
    """

    def __init__(self, pooler: PoolerConfig, params: PoolingParams, num_prompt_tokens: int):
        self.pooling_type, self.params, self.num_prompt_tokens = pooler.pooling_type, params, num_prompt_tokens
        self.normalize = pooler.normalize if params.normalize is None else params.normalize
        self._sum: torch.Tensor | None = None  # (hidden,) fp32

    @property
    def needs_whole_prompt(self) -> bool:
        """Every prompt position's hidden state counts (MEAN, CLS): no prefix-cache reuse."""
        return self.pooling_type != "LAST"

    def positions(self, start: int, end: int) -> range:
        """The prompt positions in ``[start, end)`` whose hidden states this pooling needs."""
        if self.pooling_type == "MEAN":
            return range(start, end)
        want = 0 if self.pooling_type == "CLS" else self.num_prompt_tokens - 1
        return range(want, want + 1) if start <= want < end else range(0)

    def add(self, hidden: torch.Tensor, start: int) -> None:
        """Add ``hidden`` ((rows, hidden) final hidden states of :meth:`positions`, any float dtype) from a
        chunk starting at prompt position ``start``."""
        part = hidden.float().sum(0)
        self._sum = part if start == 0 or self._sum is None else self._sum + part

    def result(self) -> list[float]:
        """The embedding: the pooled vector (the mean for MEAN), cut to ``dimensions``, normalised when
        asked; a list of ``dimensions`` (or hidden_size) floats."""
        v = self._sum / self.num_prompt_tokens if self.pooling_type == "MEAN" else self._sum
        if self.params.dimensions is not None:
            v = v[: self.params.dimensions]
        if self.normalize:
            v = torch.nn.functional.normalize(v, p=2, dim=0)
        return v.tolist()
