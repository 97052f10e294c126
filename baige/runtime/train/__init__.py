"""Training: ``TrainConfig`` (``config``), what every method shares (``base.TrainerBase``: set-up,
optimizer step, checkpoints, export), next-token training (``trainer.Trainer``) over packed token
windows (``data``), GRPO with rollouts from baige's engine (``rl``), torch.distributed set-up and the
parallelism transforms in torchtitan's order (``parallel``), DCP checkpoints and HF export
(``checkpoint``), metrics.jsonl and MFU (``metrics``)."""
