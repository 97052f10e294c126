"""Serving many LoRA adapters from one engine (vLLM's ``--enable-lora`` and ``LoRARequest``).

The :class:`LoRAManager` owns the adapters an engine has loaded: each gets an engine id (the
``lora_int_id`` of its sequences, never reused, so prefix-cache keys of an unloaded adapter can
never match a later one's) and a slot in the stacks :func:`baige.runtime.model.lora.attach_adapters`
puts on the model's projections. Every step the runner tells it which adapter each flattened token
uses (:meth:`LoRAManager.set_batch`); the hooks then add ``B_i A_i x * scaling_i`` per token.

Loading is split so the slow part runs off the engine thread: :meth:`LoRAManager.read` (disk,
checks) is thread-safe, :meth:`LoRAManager.add` / :meth:`LoRAManager.remove` (rebuild the stacks)
must run between steps, on the thread that steps the engine.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from baige.errors import BaigeError
from baige.runtime.model.lora import LoRABatch, attach_adapters, detach_adapters
from baige.runtime.model.transformer import Transformer
from baige.runtime.weights.peft import LoRAAdapter, load_peft_adapter


class LoRANotFound(BaigeError):
    """A request names an adapter this engine has not loaded (the server's 404)."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request (vLLM's ``LoRARequest``): its name (the ``model`` clients send),
    the caller's integer id (> 0; informational here, the engine assigns its own ids) and the PEFT
    adapter directory (loaded on first use offline)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class LoadedLoRA:
    request: LoRARequest
    adapter: LoRAAdapter
    engine_id: int  # the sequences' lora_int_id (> 0)


class LoRAManager:
    """The loaded adapters of one engine and the model's stacks built from them.

    Args:
        model: the served Transformer (its projections get the stacks).
        max_lora_rank: largest adapter rank accepted (vLLM's ``--max-lora-rank``).
        lora_roots: when given, the only directories adapters may be read from (``--lora-root``).
    """

    def __init__(self, model: Transformer, max_lora_rank: int, lora_roots: tuple[str, ...] = ()):
        self.model, self.max_lora_rank = model, max_lora_rank
        self.lora_roots = lora_roots
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.batch = LoRABatch()
        self.loaded: dict[str, LoadedLoRA] = {}  # by name, in load order (= slot order)
        self._slot: dict[int, int] = {}  # engine id -> slot in the stacks
        self._ids = itertools.count(1)
        self._read_lock = threading.Lock()
        self.version = 0  # bumped whenever the stacks are rebuilt (the native decode table follows it)

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter directory (any thread; the model is only read).

        Raises:
            BaigeError (one line): an empty name, a name already loaded, a path outside ``lora_roots``
            (:func:`resolve_lora_path`), an adapter that does not fit the base (targets, shapes: see
            ``load_peft_adapter``) or whose rank exceeds ``max_lora_rank``.
        """
        name = request.lora_name
        if not isinstance(name, str) or not name:
            raise BaigeError(
                f"lora_name {name!r}: an adapter needs a non-empty name other than the base model's", param="lora_name"
            )
        if name in self.loaded:
            raise BaigeError(f"the LoRA adapter {name!r} is already loaded", param="lora_name")
        with self._read_lock:
            try:
                path = resolve_lora_path(request.lora_path, self.lora_roots)
                return load_peft_adapter(path, self.model, self.dtype, self.max_lora_rank)
            except BaigeError as e:
                raise BaigeError(f"LoRA adapter {name!r}: {e}", param=e.param or "lora_path") from None

    def add(self, request: LoRARequest, adapter: LoRAAdapter) -> int:
        """Register an adapter :meth:`read` returned and rebuild the stacks (between steps).
        Returns its engine id. Raises BaigeError when the name was loaded meanwhile."""
        if request.lora_name in self.loaded:
            raise BaigeError(f"the LoRA adapter {request.lora_name!r} is already loaded", param="lora_name")
        engine_id = next(self._ids)
        self.loaded[request.lora_name] = LoadedLoRA(request, adapter, engine_id)
        self._rebuild()
        return engine_id

    def load(self, request: LoRARequest) -> int:
        """:meth:`read` then :meth:`add` (on the engine's thread). Returns the engine id."""
        return self.add(request, self.read(request))

    def remove(self, name: str, in_flight: list[int]) -> None:
        """Forget an adapter and rebuild the stacks (between steps). ``in_flight``: the
        ``lora_int_id`` of every unfinished request.

        Raises:
            LoRANotFound: a name not loaded.
            BaigeError: requests that use it are in flight (they go on unharmed; unload it later).
        """
        busy = in_flight.count(self.get(name).engine_id)
        if busy:
            raise BaigeError(
                f"the LoRA adapter {name!r} is in use by {busy} request(s) in flight; unload it once they finish",
                param="lora_name",
            )
        del self.loaded[name]
        self._rebuild()

    def update(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights of the loaded adapter ``name`` (between steps; RL weight sync of a LoRA run):
        ``(key, tensor)`` pairs named ``<module>.lora_A.weight`` (r, in) / ``<module>.lora_B.weight``
        (out, r), as a training model's ``named_parameters()`` or PEFT's file (``base_model.model.``
        prefix) name them, for modules the adapter has (its ranks and scalings stay). All pairs are
        checked before any is used; then the stacks are rebuilt.

        Raises:
            LoRANotFound: ``name`` is not loaded.
            BaigeError: a key that is not one of the adapter's lora_A/lora_B weights, or a shape that
            differs from the adapter's (each names the key).
        """
        modules = self.get(name).adapter.modules
        new: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        for key, t in named_tensors:
            module, _, which = key.removeprefix("base_model.model.").rpartition(".lora_")
            if module not in modules or which not in ("A.weight", "B.weight"):
                raise BaigeError(f"update_weights: {key!r} is not a lora_A/lora_B weight of the adapter {name!r}")
            a, b, scaling = new.get(module, modules[module])
            old = a if which == "A.weight" else b
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(old.shape):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise BaigeError(f"update_weights: {key} is {shape}, the adapter's is {tuple(old.shape)}")
            t = t.detach().to(old.device, old.dtype)
            new[module] = (t, b, scaling) if which == "A.weight" else (a, t, scaling)
        modules.update(new)
        self._rebuild()

    def get(self, name: str) -> LoadedLoRA:
        """The loaded adapter called ``name``. Raises LoRANotFound."""
        found = self.loaded.get(name)
        if found is None:
            raise LoRANotFound(f"the LoRA adapter {name!r} is not loaded", param="model")
        return found

    def engine_id(self, request: LoRARequest) -> int:
        """The engine id of ``request``'s adapter, loading it from ``lora_path`` the first time its
        name is seen (vLLM's offline behaviour); a request without a path only finds loaded ones.

        Raises:
            LoRANotFound: no adapter of that name is loaded and the request has no path.
            BaigeError: as :meth:`read`; or the name is loaded from another directory than the
            request's ``lora_path`` (unload it first, or use another name).
        """
        found = self.loaded.get(request.lora_name)
        if found is None:
            if not request.lora_path:
                raise LoRANotFound(f"the LoRA adapter {request.lora_name!r} is not loaded", param="model")
            return self.load(request)
        if request.lora_path and not _same_path(request.lora_path, found.request.lora_path):
            raise BaigeError(
                f"the LoRA adapter {request.lora_name!r} is loaded from {found.request.lora_path}, "
                f"not {request.lora_path}: unload it first or give this one another name",
                param="lora_path",
            )
        return found.engine_id

    def _rebuild(self) -> None:
        self.version += 1
        detach_adapters(self.model)
        adapters = list(self.loaded.values())
        self._slot = {a.engine_id: i for i, a in enumerate(adapters)}
        if adapters:
            attach_adapters(self.model, [a.adapter.modules for a in adapters], self.batch, self.dtype)

    def set_batch(self, lora_ids: list[int]) -> bool:
        """Set the adapter of each of the step's N flattened tokens (``lora_ids``: each token's
        sequence's ``lora_int_id``, 0 = base) as slots in ``batch.token_lora_ids`` ((N,) int64, -1 =
        base); None when no token uses an adapter. Returns whether any does."""
        if not any(lora_ids):
            self.batch.token_lora_ids = None
            return False
        slots = [self._slot[i] if i else -1 for i in lora_ids]
        self.batch.token_lora_ids = torch.tensor(slots, dtype=torch.long, device=self.device)
        return True


def resolve_lora_path(lora_path: str, roots: tuple[str, ...] = ()) -> Path:
    """``lora_path`` made absolute with its symlinks and ``..`` resolved; with ``roots`` (``--lora-root``,
    as vLLM's ``--allowed-local-media-path``) it must lie inside one of them, so a client of
    ``/v1/load_lora_adapter`` cannot make the server read any directory it can name.

    Raises:
        BaigeError: (param ``lora_path``) an empty or unresolvable path, or one outside every root.
    """
    if not isinstance(lora_path, str) or not lora_path or "\x00" in lora_path:
        raise BaigeError(f"lora_path {str(lora_path)[:80]!r} is not a path", param="lora_path")
    try:
        path = Path(lora_path).expanduser().resolve()
        resolved_roots = [Path(r).expanduser().resolve() for r in roots]
    except (OSError, RuntimeError) as e:
        raise BaigeError(f"lora_path {lora_path!r} cannot be resolved ({e})", param="lora_path") from None
    if resolved_roots and not any(path.is_relative_to(r) for r in resolved_roots):
        raise BaigeError(
            f"lora_path {lora_path!r} ({path}) is outside --lora-root ({', '.join(map(str, resolved_roots))})",
            param="lora_path",
        )
    return path


def _same_path(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b
