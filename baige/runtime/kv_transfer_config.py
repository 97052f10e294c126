"""``--kv-transfer-config`` (prefill/decode disaggregation, vLLM's ``KVTransferConfig`` keys): the
dataclass :class:`baige.runtime.config.EngineConfig` parses its flag into."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from baige.errors import BaigeError
from baige.runtime.json_flag import json_flag_object


def _is_plain_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---- prefill/decode disaggregation (--kv-transfer-config) ---------------------------------------
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_EXTRA_KEYS = {"transfer_timeout": 30.0, "abort_request_timeout": 120.0}


@dataclass(frozen=True)
class KVTransferConfig:
    """How an engine ships or receives prompts' KV blocks (vLLM's ``KVTransferConfig`` keys).

    ``kv_connector``: ``"auto"`` or a transport of ``infer/kv_transfer/registry.py``; ``kv_role``: one of
    :data:`KV_ROLES`; ``engine_id``: the name in ``kv_transfer_params`` (None: random); ``kv_ip`` /
    ``kv_port``: where the producer's block server binds and what it advertises (port 0: a free one);
    ``kv_connector_extra_config``: :data:`KV_EXTRA_KEYS`, seconds (a consumer's wait for a pull; how long a
    producer keeps unpulled blocks, vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``).
    """

    kv_connector: str = ""
    kv_role: str = ""
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(msg: str):
            raise BaigeError(f"--kv-transfer-config: {msg}", param="kv_transfer_config")

        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            bad(f'give "kv_connector": "auto" or a transport name (got {self.kv_connector!r})')
        if self.kv_role not in KV_ROLES:
            bad(f"kv_role {self.kv_role!r} is not one of {', '.join(KV_ROLES)}")
        for key, value in (("engine_id", self.engine_id or "-"), ("kv_ip", self.kv_ip)):
            if not isinstance(value, str) or not value:
                bad(f"{key} must be a non-empty string, got {value!r}")
        if not _is_plain_int(self.kv_port) or not 0 <= self.kv_port <= 65535:
            bad(f"kv_port must be an integer in [0, 65535], got {self.kv_port!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            bad("kv_connector_extra_config must be a JSON object")
        for key, value in extra.items():
            if key not in KV_EXTRA_KEYS:
                bad(f"kv_connector_extra_config: unknown key {key!r} (known: {', '.join(KV_EXTRA_KEYS)})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
                bad(f"kv_connector_extra_config.{key} must be seconds in (0, 86400], got {value!r}")

    def extra(self, key: str) -> float:
        """A ``kv_connector_extra_config`` value in seconds (its default when not given)."""
        return float(self.kv_connector_extra_config.get(key, KV_EXTRA_KEYS[key]))

    @classmethod
    def parse(cls, value: "str | dict | KVTransferConfig | None") -> "KVTransferConfig | None":
        """From a JSON object text, a dict or a config (None stays None). Raises BaigeError naming the
        bad key or value (unknown keys are refused)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_flag_object(
            value,
            "--kv-transfer-config",
            '{"kv_connector": "auto", "kv_role": "kv_producer"}',
            {f.name for f in fields(cls)},
        )
        return cls(**value)
