"""Node settings, computed once by `python -m inference_node` and handed to vLLM's processes.

The middleware (API server process) reads them from the environment; the connector (engine and worker
processes) from `kv_connector_extra_config`. Both carry the same JSON.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from inferscale_kv.embedding_model import DEFAULT_EMBEDDING_MODEL
from inferscale_kv.limits import HYBRID_CANDIDATES, MAX_MEMORY_TOP_K
from inferscale_kv.options import option

SETTINGS_ENV = "INFERSCALE_NODE_SETTINGS"
MISS_POLICIES = ("auto", "wait", "best-effort")  # --kv-miss-policy (inference_node.connector.miss_policy)
WARM_UP_EVERY_S = 600.0  # --warm-facts: a user's warm-up is asked again after this long


@dataclass(frozen=True)
class NodeSettings:
    """The settings `python -m inference_node` hands vLLM's processes. Those declared with `option()` are the node's
    flags as they stand (`--node-cache-mb`, INFERSCALE_NODE_NODE_CACHE_MB); the others it computes."""

    memory_service: str
    node_id: str
    model_dir: str
    profile: dict = field(default_factory=dict)  # ModelProfile.as_dict()
    node_cache_mb: int = option(
        0, help="device memory for cached fact KV, per tensor-parallel rank (MiB; the node cache's device tier). 0: "
        "chosen from the device: a quarter of what --gpu-memory-utilization leaves vLLM after the model's weights "
        "(the rest stays vLLM's paged cache), at least 512 MiB; 1024 MiB on a CPU node")
    host_tier_mb: int | None = option(
        None, help="pinned host memory for fact KV behind the device tier, per tensor-parallel rank (MiB; chunks "
        "fetched from the memory service stay there, so that a device eviction leaves them one host-to-device copy "
        "away; 0: none; each entry counted at the size PyTorch pins for it, a power of two per tensor). Not "
        "given: a quarter of the host's memory (or of the container's limit) shared by the ranks, at most 64 GiB; "
        "none on a CPU node, whose device tier is host memory already")
    kv_miss_policy: str = option(
        "auto", choices=MISS_POLICIES,
        help="a request whose memory is not all in the device tier: auto waits for the missing KV only where "
        "bringing its bytes (at each tier's measured bandwidth) is faster than prefilling it, else loads the "
        "resident prefix and prefills the rest while the missing KV is fetched in the background; wait waits (but "
        "for KV that cannot fit the device tier); best-effort never does")
    kv_durable_tier: str = option(
        "", help="read fact KV straight from the memory service's durable tier, asking the service only for what it "
        "lacks: its KV directory (<its --data-dir>/kv/blobs, mounted read-only) or s3://BUCKET/PREFIX/kv (its "
        "--store-uri and /kv; endpoint from AWS_ENDPOINT_URL, read-only credentials from AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY). It lets the node read every tenant's KV there: for nodes trusted with every tenant. "
        "Empty: every fetch over FetchKv")
    retrieve_timeout_s: float = option(
        2.0, help="deadline of the RetrieveAndStage call; past it the request is answered without memory")
    fetch_timeout_s: float = option(
        10.0, help="deadline of a fact-KV fetch from the memory service; past it the request's memory is prefilled")
    default_top_k: int = option(20, flag="memory-top-k", help="facts per request when the request does not say")
    warm_facts: int = option(
        50, help=f"kv mode: on a user's first request to this node in {WARM_UP_EVERY_S:.0f} s, this many more of the "
        "user's facts (the next best for its question) are fetched into the host tier in the background, for the "
        f"user's next requests (with the request's own, at most {HYBRID_CANDIDATES}; 0: none)")
    max_top_k: int = MAX_MEMORY_TOP_K  # the largest memory.top_k and recompute_tail_facts (not a flag)
    # kv mode: the m retrieved facts nearest the question are prefilled as text after the injected ones (they then
    # attend to the header and every other fact); a request may ask for another m (memory.recompute_tail_facts).
    # None by default: a longer tail did not improve answers beyond noise and costs kv's engine TTFT
    # (benchmarks/RESULTS.md, "LoCoMo quality" and "Serving").
    recompute_tail_facts: int = option(
        0, help="kv mode: prefill the m facts nearest the question as text after the injected ones")
    # kv mode: a memory whose injectable part is shorter than this (tokens) is served as text, where injecting it
    # was measured slower than prefilling it (--kv-crossover-tokens, resolved: inference_node.crossover); a request
    # may ask for another value (memory.kv_crossover_tokens).
    kv_crossover_tokens: int = 0
    # Speed runs only: fact KV of the right shape is made up on a node-cache miss instead of fetched, so the
    # engine side can be measured without a memory service. Never set in serving (benchmarks say it when set).
    synthetic_kv: bool = False
    # When set, the worker-side connector appends one JSON line per load (tokens, milliseconds) to this file.
    load_stats_path: str = option(
        "", help="benchmarks only: append per-load timings (JSON lines; synchronizes the device per load)")
    embed_queries_locally: bool = option(
        False, help="embed each query on this node's device and send the vector with RetrieveAndStage (the memory "
        "service then spends no CPU on it)")
    embedding_model: str = option(
        DEFAULT_EMBEDDING_MODEL, help="the memory service's --embedding-model (for --embed-queries-locally)")
    # When set, requests without the header, or naming another user, get HTTP 403.
    user_header: str = option(
        "", help="request header naming the caller's user (set by your authenticating gateway); when set, "
        "memory.user_id must equal it")
    # When set, a request with memory must carry the header exactly once (HTTP 401 otherwise).
    user_token_header: str = option(
        "", help="request header holding the short-lived user token your gateway mints for the user it "
        "authenticated (a JWT): forwarded with RetrieveAndStage and FetchKv to a memory service that binds node "
        "reads to users (its --user-token-public-key-file); empty: none sent")

    # Chat requests with memory reach vLLM as their rendered prompt's token ids (inference_node.placement), unless
    # vLLM renders this model's chat otherwise than its tokenizer's template (vllm_renders_chat_with_the_tokenizer).
    chat_token_ids: bool = True
    # The most tokens a prompt can have on this node (at least): the middleware tokenizes no longer text itself.
    max_model_len: int = 0

    @property
    def profile_id(self) -> str:
        return self.profile["profile_id"]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_mapping(cls, values: dict) -> NodeSettings:
        return cls(**{key: value for key, value in values.items() if key in cls.__dataclass_fields__})

    @classmethod
    def from_env(cls) -> NodeSettings:
        raw = os.environ.get(SETTINGS_ENV)
        if not raw:
            raise RuntimeError(f"{SETTINGS_ENV} is not set: start the node with `python -m inference_node`")
        return cls.from_mapping(json.loads(raw))
