"""Reinforcement learning in ``baige train``: GRPO (``--method grpo``) with rollouts from baige's own
engine: the config section (``config``), prompts (``prompts``), rewards (``rewards``), rollouts and
weight sync (``rollout``), micro-batches and the policy's logprobs (``batch``), the loss (``loss``) and
the trainer (``grpo``)."""
