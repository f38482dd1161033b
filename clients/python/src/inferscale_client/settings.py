"""Where the memory service is and how to reach it: one place for the address, the bearer token, TLS and mutual
TLS, deadlines and retries. Every setting also comes from an `INFERSCALE_*` variable (`ClientSettings.from_env`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import grpc

ENV_PREFIX = "INFERSCALE_"
# The service's default limits (memory_service/config.py): ingest is split under them.
MAX_FACTS_PER_CALL = 1000
MAX_TURNS_PER_CALL = 10_000
MAX_DELETE_IDS = 10_000
# A call's request stays under this many bytes (gRPC's retry buffer is far smaller; the service takes 64 MiB).
MAX_CALL_BYTES = 4 << 20
# The retry policy the inference nodes and workers use (inferscale_kv/call_credentials.py): UNAVAILABLE (a replica
# went away) is retried on another replica for the calls that are harmless to repeat; deletes are not.
RETRIED_METHODS = ("IngestFacts", "IngestTurns", "SearchFacts", "ListFacts", "GetStats")
RETRY_POLICY = {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}
SERVICE = "inferscale.v1.MemoryService"


@dataclass(frozen=True)
class ClientSettings:
    """`memory_service`: one address for every replica (`dns:///memory-service-headless.ns:50051`,
    `ipv4:10.0.0.1:50051,10.0.0.2:50051`, or `host:port`); `token`: the app's bearer token; `tls_ca_file` turns
    TLS on, with `tls_cert_file` / `tls_key_file` for a service that requires client certificates; `timeout_s`:
    each call's deadline."""

    memory_service: str = "127.0.0.1:50051"
    token: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    timeout_s: float = 30.0

    @classmethod
    def from_env(cls, **overrides: object) -> ClientSettings:
        """Each setting from `INFERSCALE_<NAME>` (INFERSCALE_MEMORY_SERVICE, INFERSCALE_TOKEN, ...), then
        `overrides` (those not None)."""
        values: dict[str, object] = {}
        for setting in fields(cls):
            raw = os.environ.get(ENV_PREFIX + setting.name.upper())
            if raw is not None:
                values[setting.name] = float(raw) if setting.name == "timeout_s" else raw
        values.update({name: value for name, value in overrides.items() if value is not None})
        return cls(**values)  # type: ignore[arg-type]

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls_ca_file:
            return None
        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.tls_ca_file), read(self.tls_key_file),
                                            read(self.tls_cert_file))

    def channel_options(self) -> list[tuple[str, str | int]]:
        service_config = {"loadBalancingConfig": [{"round_robin": {}}], "methodConfig": [
            {"name": [{"service": SERVICE, "method": method} for method in RETRIED_METHODS],
             "retryPolicy": RETRY_POLICY}]}
        return [("grpc.service_config", json.dumps(service_config)), ("grpc.enable_retries", 1),
                ("grpc.max_receive_message_length", 64 << 20)]

    def metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        token = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        return (*token, ("x-request-id", request_id))
