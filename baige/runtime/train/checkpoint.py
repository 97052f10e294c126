"""Training checkpoints with torch.distributed.checkpoint (DCP), and the final HF export.

Layout under ``<output>/checkpoints``: ``step_00000010/`` (DCP shards ``*.distcp``, ``.metadata``,
and the resolved ``config.toml``). A step is written as ``.tmp-step_00000010`` and renamed by rank 0
once every rank's shards and DCP's ``.metadata`` are on disk, so a directory named ``step_*`` is always
complete; a run killed mid-write (synchronous or in the background) leaves only a ``.tmp-*`` directory,
removed at the next start, and the newest ``step_*`` stays the resume point. DCP reshards on load: a
checkpoint saved by N ranks loads on M ranks (same global model).

``checkpoint.async_mode`` (torchtitan's names): ``disabled`` writes on the training's critical path
(``dcp.save``); ``async`` stages the state into fresh host memory (a copy, on the critical path), then
DCP's ``async_save`` writes it from a background thread while training goes on; ``async_with_pinned_mem``
also stages in the background, into host buffers kept from one save to the next (page-locked on CUDA,
copied on a side stream), and the trainer waits for the copy before the next optimizer step changes
the parameters (:meth:`CheckpointManager.before_optimizer_step`). At most one save is in flight: a save
first waits for the previous one. The background writes use their own gloo process group, so their
collectives never interleave with the training's.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from baige.errors import BaigeError
from baige.runtime.settings import settings

_STEP_RE = re.compile(r"step_(\d+)")
HOLD_LIMIT_S = 600.0  # the longest a held write (BAIGE_TEST_CHECKPOINT_HOLD) waits for its marker to go


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _writer(path: Path, step: int):
    """DCP's file writer for ``path``; for the step named by ``BAIGE_TEST_CHECKPOINT_HOLD`` one whose
    ``write_data`` (each rank's shard write, which reads the staged state) first creates the marker file
    and waits until it is removed (at most ``HOLD_LIMIT_S``): a write held in flight."""
    from torch.distributed.checkpoint import FileSystemWriter

    hold = settings().checkpoint_hold
    if hold is None or hold[0] != step:
        return FileSystemWriter(str(path))
    marker = hold[1]

    class HeldWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            marker.touch()
            deadline = time.monotonic() + HOLD_LIMIT_S
            while marker.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            return super().write_data(plan, planner)

    return HeldWriter(str(path))


def _write_failed(name: str, e: BaseException) -> BaigeError:
    """One line for a failed write of checkpoint ``name``: the first failing rank's exception when DCP
    gathered them (its ``CheckpointException``, a BaseException carrying every rank's traceback)."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (exc, _) = next(iter(failures.items()))
        return BaigeError(f"checkpoint {name}: the write failed on rank {rank}: {type(exc).__name__}: {exc}")
    return BaigeError(f"checkpoint {name}: the write failed: {type(e).__name__}: {e}")


@dataclass
class _Save:
    """One save from its start until it is complete. Times in seconds (``time.perf_counter``)."""

    step: int
    final: Path
    started: float
    done: Future = field(default_factory=Future)  # the final path once written (and renamed on rank 0)
    staging: Future | None = None  # async_with_pinned_mem: the background copy into host memory
    blocking_s: float = 0.0  # time the training waited for this save (its critical path)
    wait_s: float = 0.0  # the part of it spent waiting for the write to end (at the next save or the end)
    write_s: float | None = None  # from the start until every shard and .metadata were on disk
    staged: bool = False  # the "staged" event is recorded (once: the staging thread or the trainer's wait)


class CheckpointManager:
    """Save / find / load training checkpoints in ``root``; only rank 0 touches directory names.

    ``events`` records, in order and from every thread, ``(event, step)``: ``save`` (a save begins),
    ``staged`` (its state copied to host memory), ``optimizer_step`` (the trainer is about to change the
    parameters, :meth:`before_optimizer_step`), ``written`` (this rank's shards and DCP's ``.metadata`` on
    disk), ``complete`` (rank 0 renamed the directory). ``log`` receives one record per save when it is
    complete: ``{"split": "checkpoint", "step", "async_mode", "critical_path_seconds", "wait_seconds",
    "write_seconds"}`` (the time the training waited for it, the part of that spent waiting for the write
    to end, and the time until it was on disk).

    Collective: every rank constructs one (an async mode creates the checkpoint's gloo process group).
    """

    def __init__(
        self,
        root: Path,
        is_main: bool,
        keep_latest: int,
        async_mode: str = "disabled",
        log: Callable[[dict], None] | None = None,
    ):
        self.root, self.is_main, self.keep_latest = Path(root), is_main, keep_latest
        self.async_mode, self._log = async_mode, log
        self.events: deque[tuple[str, int]] = deque(maxlen=1024)
        self._staged_lock = threading.Lock()
        self._pending: _Save | None = None
        self._pg = dist.new_group(backend="gloo") if async_mode != "disabled" and dist.is_initialized() else None
        self._stager = None
        if async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
                )
            )

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
        """The checkpoint to resume from: ``auto`` (the newest complete step; None, a fresh start, when
        there is none, also after an interrupted first save), ``none`` (start fresh) or a path to a step
        directory. ``auto`` is what an elastic restart (torchrun ``--max-restarts``) or a requeued job
        relies on.

        Raises:
            BaigeError: ``none`` with complete checkpoints present (they would be overwritten); a path
            that is not a complete checkpoint.
        """
        steps = self.complete_steps()
        if resume == "auto":
            return steps[-1][1] if steps else None
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

    def _record(self, event: str, step: int) -> None:
        self.events.append((event, step))

    def _mark_staged(self, save: _Save) -> None:
        """Record ``staged`` for ``save`` once: from the staging future's callback (DCP's thread) or from
        the trainer's wait for it, whichever comes first (a future's waiters may wake before its callbacks
        run, and the trainer's next event must come after this one)."""
        with self._staged_lock:
            if not save.staged:
                save.staged = True
                self._record("staged", save.step)

    def _publish(self, step: int, config_toml: str) -> Path:
        """Rank 0, once the write of ``step`` is on disk: its config.toml, the rename that makes it
        complete, then the old checkpoints past ``keep_latest`` removed."""
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"
        (tmp / "config.toml").write_text(config_toml)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        self._record("complete", step)
        if self.keep_latest > 0:
            for _, old in self.complete_steps()[: -self.keep_latest]:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def save(self, step: int, state: dict[str, Any] | Callable[[], dict[str, Any]], config_toml: str) -> Path:
        """Write ``state`` (or what calling it returns: its time counts as the save's) for ``step``
        (collective: every rank calls it); with an async mode, start writing it and return once it is
        staged. Waits first for a save still in flight. Returns the directory the checkpoint has (async:
        will have) once complete.

        Raises:
            BaigeError: the previous background write failed.
        """
        import torch.distributed.checkpoint as dcp

        self.wait()
        save = _Save(step, self.root / step_dir_name(step), time.perf_counter())
        tmp = self.root / f".tmp-{save.final.name}"
        self._record("save", step)
        state = state() if callable(state) else state
        if self.async_mode != "disabled":
            return self._save_async(save, tmp, state, config_toml)
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        with warnings.catch_warnings():  # DCP warns that one process means no process group: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.save(state, storage_writer=_writer(tmp, step), no_dist=not dist.is_initialized())
            except (Exception, CheckpointException) as e:
                raise _write_failed(save.final.name, e) from e
        self._record("written", step)
        _barrier()
        if self.is_main:
            self._publish(step, config_toml)
        _barrier()
        save.write_s = save.blocking_s = time.perf_counter() - save.started
        self._report(save)
        return save.final

    def _save_async(self, save: _Save, tmp: Path, state: dict[str, Any], config_toml: str) -> Path:
        """DCP's ``async_save`` on the checkpoint's process group; the write's completion (and, on rank 0,
        :meth:`_publish`) runs in DCP's writer thread and resolves ``save.done``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # .tmp-* directories were removed at the start (clean_partial): no rank can meet an old one here
        tmp.mkdir(parents=True, exist_ok=True)
        stager = self._stager or DefaultStager(StagingOptions(False, False, False, False))  # a fresh host copy
        if self._stager is not None and torch.cuda.is_available():
            # the background copy runs on its own stream, which does not wait for the work queued on this
            # one: the optimizer step that produced the parameters must be done before it reads them
            torch.cuda.current_stream().synchronize()
        # one process: DCP warns from its writer thread, where a catch_warnings block cannot reach
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        response = dcp.async_save(
            state,
            storage_writer=_writer(tmp, save.step),
            process_group=self._pg,
            async_stager=stager,
            no_dist=not dist.is_initialized(),
        )
        upload = getattr(response, "upload_completion", response)
        save.staging = getattr(response, "staging_completion", None)
        if save.staging is None:
            self._mark_staged(save)
        else:
            save.staging.add_done_callback(lambda _: self._mark_staged(save))

        def finished(f: Future) -> None:  # DCP's writer thread (or here, when already done)
            try:
                f.result()
                save.write_s = time.perf_counter() - save.started
                self._record("written", save.step)
                save.done.set_result(self._publish(save.step, config_toml) if self.is_main else save.final)
            except BaseException as e:  # handed to the training thread by wait()
                save.done.set_exception(e)
            finally:
                if stager is not self._stager:
                    stager.close()

        self._pending = save
        upload.add_done_callback(finished)
        save.blocking_s += time.perf_counter() - save.started
        return save.final

    def before_optimizer_step(self, step: int) -> None:
        """Called by the trainer before optimizer step ``step`` changes the parameters: waits for the
        background staging of a save in flight (``async_with_pinned_mem``; its wait is that save's
        critical path). The ``optimizer_step`` event is recorded after that wait."""
        save = self._pending
        if save is not None and save.staging is not None:
            if not save.staging.done():
                t0 = time.perf_counter()
                save.staging.result()
                save.blocking_s += time.perf_counter() - t0
            if save.staging.exception() is None:  # a failed staging surfaces with the save's write
                self._mark_staged(save)
        self._record("optimizer_step", step)

    def wait(self) -> None:
        """Wait for the save in flight, if any, and log its record. Raises BaigeError when its write failed."""
        save, self._pending = self._pending, None
        if save is None:
            return
        t0 = time.perf_counter()
        try:
            save.done.result()
        except (Exception, CheckpointException) as e:
            raise _write_failed(save.final.name, e) from e
        finally:
            save.wait_s = time.perf_counter() - t0
            save.blocking_s += save.wait_s
        self._report(save)

    def finalize(self) -> None:
        """The end of a run (collective): the save in flight complete on every rank (rank 0's rename
        included), the staging buffers freed."""
        self.wait()
        _barrier()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _report(self, save: _Save) -> None:
        if self._log is not None:
            self._log(
                {
                    "split": "checkpoint",
                    "step": save.step,
                    "async_mode": self.async_mode,
                    "critical_path_seconds": save.blocking_s,
                    "wait_seconds": save.wait_s,
                    "write_seconds": save.write_s,
                }
            )

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
