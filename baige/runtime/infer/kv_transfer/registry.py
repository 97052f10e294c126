"""The KV transports baige knows, in ``"auto"``'s order of preference (the fastest first)."""

from __future__ import annotations

from baige.errors import BaigeError
from baige.runtime.infer.kv_transfer.connector import KVConnector
from baige.runtime.infer.kv_transfer.nixl_connector import NixlConnector
from baige.runtime.infer.kv_transfer.zmq_connector import ZmqConnector

# NIXL first: one READ straight between the registered pools (RDMA where the network has it)
CONNECTORS: dict[str, type[KVConnector]] = {c.name: c for c in (NixlConnector, ZmqConnector)}


def resolve_connector(name: str) -> type[KVConnector]:
    """The transport ``name`` names, or for ``"auto"`` the first available one.

    Raises:
        BaigeError: an unknown name, or one that cannot run here (saying why).
    """
    if name == "auto":
        why = []
        for candidate, cls in CONNECTORS.items():
            reason = cls.unavailable()
            if reason is None:
                return cls
            why.append(f"{candidate}: {reason}")
        raise BaigeError(f"--kv-transfer-config: no KV transport can run here ({'; '.join(why)})")
    if name not in CONNECTORS:
        raise BaigeError(
            f"--kv-transfer-config: unknown kv_connector {name!r} (choose auto, {', '.join(CONNECTORS)})",
            param="kv_transfer_config",
        )
    reason = CONNECTORS[name].unavailable()
    if reason is not None:
        raise BaigeError(f"--kv-transfer-config: kv_connector {name!r} cannot run here: {reason}")
    return CONNECTORS[name]
