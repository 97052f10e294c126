"""Training: ``TrainConfig`` (``config``), the :class:`~.trainer.Trainer`, packed token windows
(``data``), torch.distributed set-up and the parallelism transforms in torchtitan's order
(``parallel``), DCP checkpoints and HF export (``checkpoint``), metrics.jsonl and MFU (``metrics``)."""
