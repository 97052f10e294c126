"""``baige bench``: the group (:mod:`.group`), the options its subcommands share (:mod:`.options`), and
one module per subcommand, beside the runtime module it calls (``baige.runtime.bench.<name>``)."""

from baige.cli.bench import compare, group, grpo, kernels, offline, serve, startup, train  # noqa: F401  (registers them)
