"""A training run's life between steps: stop signals, the checkpoint at a step boundary, injected faults.

- **SIGTERM / SIGINT** (SLURM's ``--signal``, Kubernetes, ``scancel``, Ctrl-C): :class:`StopSignal` turns
  the first one into a flag; at the next step boundary every rank agrees on it (one all_reduce of a flag
  per step, so all ranks stop after the same step even when only some received the signal), writes a
  checkpoint and the run ends normally (exit 0, no HF export); rerunning the same command resumes
  exactly (``--resume auto``). A second signal has its default effect at once.
- **A dead rank** (torchrun's elastic agent, ``--max-restarts N``): the agent restarts every worker, and
  ``--resume auto`` loads the newest complete checkpoint; nothing here is needed for that, only the
  fault injection the tests use (:func:`inject_fault`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from baige.runtime.settings import settings

if TYPE_CHECKING:
    from baige.runtime.train.base import TrainerBase, TrainResult

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """A context manager that turns the first SIGTERM or SIGINT into :attr:`received` (the signal's name)
    and gives a second one its previous handler (SIGTERM: the process ends; SIGINT: KeyboardInterrupt).

    Handlers are installed only in the main thread (Python delivers signals there); elsewhere the run
    keeps the process's handlers and :attr:`received` stays None.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:  # the second signal: the default behaviour, now
            self._restore()
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum).name
        # os.write, not print: the handler may interrupt a print to stderr (a buffered write is not reentrant)
        os.write(
            2, f"{self.received}: stopping after this step with a checkpoint (send it again to stop at once)\n".encode()
        )

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank received a stop signal: an all_reduce (MAX) of this rank's flag over the whole
        world, so every rank returns the same answer. Collective: every rank calls it at each step boundary."""
        flag = self.received is not None
        if not dist.is_initialized():
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def inject_fault(step: int, rank: int) -> None:
    """Fault injection for the tests (``BAIGE_TEST_FAIL_AT=STEP:RANK``): rank ``rank`` kills itself with
    SIGKILL as optimizer step ``step`` begins, in a first attempt only (an elastic restart has
    ``TORCHELASTIC_RESTART_COUNT`` >= 1), as a crashed process or a lost node would end."""
    s = settings()
    if s.fail_at == (step, rank) and s.elastic_restart_count == 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def step_boundary(trainer: TrainerBase, result: TrainResult, stop: StopSignal) -> bool:
    """After optimizer step ``trainer.step``: a checkpoint when ``checkpoint.interval`` or the last step
    says so, or when a stop signal was agreed (``result.stopped`` set: the loop ends). Collective.
    Returns whether it saved."""
    cfg = trainer.cfg
    result.stopped = stop.agreed(trainer.device) and trainer.step < cfg.training.steps
    interval = cfg.checkpoint.interval
    saved = bool((interval and trainer.step % interval == 0) or trainer.step == cfg.training.steps or result.stopped)
    if saved:
        result.checkpoint = trainer.save()
    return saved


def end_run(trainer: TrainerBase, result: TrainResult, stop: StopSignal) -> None:
    """After the loop (collective): the save in flight complete everywhere; after a stop signal, says so."""
    trainer.ckpt.finalize()
    if result.stopped:
        trainer.log.print(
            f"stopped by {stop.received or 'a stop signal on another rank'} after step {trainer.step}: "
            f"{result.checkpoint} is complete; the same command resumes from it"
        )
