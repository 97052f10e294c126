"""Training checkpoints with torch.distributed.checkpoint (DCP), and the final HF export.

Layout under ``<output>/checkpoints``: ``step_00000010/`` (DCP shards ``*.distcp``, ``.metadata``,
and the resolved ``config.toml``). A step is written as ``.tmp-step_00000010`` and renamed by rank 0
once every rank has finished, so a directory named ``step_*`` is always complete; a run killed
mid-write leaves only a ``.tmp-*`` directory, removed at the next start. DCP reshards on load: a
checkpoint saved by N ranks loads on M ranks (same global model).
"""

from __future__ import annotations

import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from baige.errors import BaigeError

_STEP_RE = re.compile(r"step_(\d+)")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    """Save / find / load training checkpoints in ``root``; only rank 0 touches directory names."""

    def __init__(self, root: Path, is_main: bool, keep_latest: int):
        self.root, self.is_main, self.keep_latest = Path(root), is_main, keep_latest

    def complete_steps(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_RE.fullmatch(p.name)
            if m and p.is_dir() and (p / ".metadata").is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def resolve_resume(self, resume: str) -> Path | None:
        """The checkpoint to resume from: ``auto`` (newest complete step, None when the folder does not
        exist yet), ``none`` (start fresh) or a path to a step directory.

        Raises:
            BaigeError: ``auto`` with a checkpoint folder holding no complete step (an interrupted
            first save: pass ``--resume none`` to start fresh); ``none`` with complete checkpoints
            present (they would be overwritten); a path that is not a complete checkpoint.
        """
        steps = self.complete_steps()
        if resume == "auto":
            if steps:
                return steps[-1][1]
            if self.root.is_dir():
                raise BaigeError(
                    f"{self.root} exists but holds no complete checkpoint (an interrupted first save?); "
                    "pass --resume none to start fresh"
                )
            return None
        if resume == "none":
            if steps:
                raise BaigeError(
                    f"{self.root} already holds checkpoints (newest: {steps[-1][1].name}); use --resume auto, "
                    "a new --output, or remove them"
                )
            return None
        path = Path(resume)
        if not (path / ".metadata").is_file():
            raise BaigeError(
                f"{path}: not a complete checkpoint (no .metadata); expected a {self.root}/step_* directory"
            )
        return path

    def clean_partial(self) -> None:
        """Remove temporary directories left by an interrupted save (rank 0; all ranks wait)."""
        if self.is_main and self.root.is_dir():
            for p in self.root.glob(".tmp-*"):
                shutil.rmtree(p, ignore_errors=True)
        _barrier()

    def save(self, step: int, state: dict[str, Any], config_toml: str) -> Path:
        """Write ``state`` for ``step`` (collective: every rank calls it). Returns the final directory."""
        import torch.distributed.checkpoint as dcp

        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        with warnings.catch_warnings():  # DCP warns that one process means no process group: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        _barrier()
        if self.is_main:
            (tmp / "config.toml").write_text(config_toml)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            if self.keep_latest > 0:
                for _, old in self.complete_steps()[: -self.keep_latest]:
                    shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    @staticmethod
    def load(path: Path, state: dict[str, Any], whole_model: bool = True) -> None:
        """Load ``path`` into ``state`` in place (collective), resharding as needed. ``whole_model``:
        ``state["model"]`` names every model tensor (False for a pipeline stage's part).

        Raises:
            BaigeError (one line, before anything is read): the checkpoint's model tensors are not
            this run's (see :func:`check_model_fits`).
        """
        import torch.distributed.checkpoint as dcp

        check_model_fits(path, state["model"], whole_model)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def check_model_fits(path: Path, model_state: dict[str, Any], whole_model: bool = True) -> None:
    """Raise a one-line BaigeError when the model part of the DCP checkpoint at ``path`` is not the
    tensors of ``model_state`` (the run's ``get_state_dict`` output: FQN -> tensor or DTensor, global
    shapes): a name missing on either side (the checkpoint's extra names only with ``whole_model``;
    a pipeline stage holds a part) or a different shape, e.g. a resume with another
    ``[lora]`` rank or targets, LoRA against full fine-tuning, or another model. The checkpoint's
    own settings are in its ``config.toml``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {k[len("model.") :]: v for k, v in meta.items() if k.startswith("model.")}
    hint = f"resume with the settings in {path / 'config.toml'}, or start a new --output"
    for name, t in model_state.items():
        m = saved.get(name)
        if m is None:
            what = f" ({len(saved)} model tensors, e.g. {next(iter(saved))})" if saved else ""
            raise BaigeError(
                f"{path} does not hold {name}, which this run trains{what}: it was saved with "
                f"another model or [lora] config; {hint}"
            )
        if isinstance(m, TensorStorageMetadata) and hasattr(t, "shape") and tuple(m.size) != tuple(t.shape):
            raise BaigeError(
                f"{path} holds {name} of shape {tuple(m.size)}, this run's is {tuple(t.shape)}: it "
                f"was saved with another model or [lora] config; {hint}"
            )
    extra = sorted(set(saved) - set(model_state)) if whole_model else []
    if extra:
        raise BaigeError(
            f"{path} holds {extra[0]} (and {len(extra) - 1} more) that this run does not train: it "
            f"was saved with another model or [lora] config; {hint}"
        )


def optimizer_state_is_flat(path: Path) -> bool:
    """Whether the checkpoint at ``path`` stores the optimizer state flattened per parameter name
    (``optimizer.param_groups.<name>.lr``, written since pipeline parallel) rather than nested
    (``optimizer.param_groups.0.lr``: the param group's index), from DCP's ``.metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    return "optimizer.param_groups.0.lr" not in FileSystemReader(str(path)).read_metadata().state_dict_metadata


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The torch RNG states this process uses (CPU, and the current CUDA device when on CUDA)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def export_hf(
    model: torch.nn.Module,
    config: dict,
    out_dir: Path,
    tokenizer_dir: Path | None,
    dtype: torch.dtype,
    is_main: bool,
    full_state_dict: Callable[[], dict[str, torch.Tensor]] | None = None,
) -> Path | None:
    """Gather the full model (collective) and write an HF directory from rank 0 (``save_hf_checkpoint``:
    safetensors, config.json, generation_config.json, tokenizer files; lm_head dropped when tied).

    ``full_state_dict`` gathers the state instead (collective; the full dict on rank 0): pipeline
    parallel, where no rank holds every stage. An existing export at ``out_dir`` is replaced.
    Returns ``out_dir`` on rank 0, None elsewhere.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from baige.runtime.weights.safetensors_io import save_hf_checkpoint

    full = (
        full_state_dict()
        if full_state_dict is not None
        else get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    )
    result = None
    if is_main:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
        if out_dir.exists():
            shutil.rmtree(out_dir)
        result = save_hf_checkpoint(state, config, out_dir, tokenizer_dir)
    _barrier()
    return result
