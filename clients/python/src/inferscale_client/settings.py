"""Where the memory service is and how to reach it: one place for the address, the bearer token, TLS and mutual
TLS, deadlines and retries. Every setting also comes from an `INFERSCALE_MEMORY_SERVICE*` variable
(`ClientSettings.from_env`, `ENV`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import grpc

ENV_PREFIX = "INFERSCALE_"
# The variable of each setting: the memory service's own INFERSCALE_TLS_* name its server certificate.
ENV = {"memory_service": "INFERSCALE_MEMORY_SERVICE", "token": "INFERSCALE_MEMORY_SERVICE_TOKEN",
       "tls_ca_file": "INFERSCALE_MEMORY_SERVICE_TLS_CA_FILE",
       "tls_cert_file": "INFERSCALE_MEMORY_SERVICE_TLS_CERT_FILE",
       "tls_key_file": "INFERSCALE_MEMORY_SERVICE_TLS_KEY_FILE", "timeout_s": "INFERSCALE_MEMORY_SERVICE_TIMEOUT_S"}
# The service's default limits (memory_service/config.py): ingest is split under them.
MAX_FACTS_PER_CALL = 1000
MAX_TURNS_PER_CALL = 10_000
MAX_DELETE_IDS = 10_000
# A call's request stays under this many bytes: gRPC retries only calls that fit its 256 KiB retry buffer.
MAX_CALL_BYTES = 200 << 10
# The retry policy the inference nodes and workers use (inferscale_kv/call_credentials.py): UNAVAILABLE (a replica
# went away) is retried on another replica for the calls that are harmless to repeat; deletes are not.
RETRIED_METHODS = ("IngestFacts", "IngestTurns", "SearchFacts", "ListFacts", "GetStats")
RETRY_POLICY = {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}
SERVICE = "inferscale.v1.MemoryService"


@dataclass(frozen=True)
class ClientSettings:
    """`memory_service`: one address for every replica (`dns:///memory-service-headless.ns:50051`,
    `ipv4:10.0.0.1:50051,10.0.0.2:50051`, or `host:port`); `token`: the app's bearer token; any `tls_*` setting turns
    TLS on: `tls_ca_file` the service certificate's CA (else the system's roots), `tls_cert_file` and `tls_key_file`
    (both or neither) a client certificate for a service that requires one; `timeout_s`: each call's deadline."""

    memory_service: str = "127.0.0.1:50051"
    token: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    timeout_s: float = 30.0

    @classmethod
    def from_env(cls, **overrides: object) -> ClientSettings:
        """Each setting from its variable (`ENV`: INFERSCALE_MEMORY_SERVICE, INFERSCALE_MEMORY_SERVICE_TOKEN, ...),
        then `overrides` (those not None)."""
        values: dict[str, object] = {}
        for setting in fields(cls):
            raw = os.environ.get(ENV[setting.name])
            if raw is not None:
                values[setting.name] = float(raw) if setting.name == "timeout_s" else raw
        values.update({name: value for name, value in overrides.items() if value is not None})
        return cls(**values)  # type: ignore[arg-type]

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls_ca_file or self.tls_cert_file or self.tls_key_file):
            return None
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file: give both (a client certificate and its key) or neither")
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
