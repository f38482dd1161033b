"""Fixtures for inference node tests: memory service + precomputed tiny-model KV + a real vLLM node."""

from __future__ import annotations

import itertools
import json
import secrets
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from harness.inference_node import InferenceNodeProcess
from inference_node.plan import PLAN_SECRET_ENV, ChunkLoad
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.blob import KvBlobHeader, encode_kv_blob
from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, HEADER_VERSION, KvKey, content_id
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
from inferscale_kv.stored_text import StoredTextGuard
from memory_service.servicer import fetch_kv_response_bytes
from precompute_worker.worker import profile_message


@dataclass
class Completion:
    text: str
    tokens: list[int]
    logprobs: list[float]
    usage: dict
    summary: dict


def tiny_profile(model_dir: Path) -> pb.KvProfile:
    from transformers import AutoTokenizer

    return profile_message(build_model_profile(model_dir, AutoTokenizer.from_pretrained(model_dir), "float32",
                                               DEFAULT_CONTEXT_WINDOW))


def complete(node: InferenceNodeProcess, prompt: str, memory: dict | None, max_tokens: int = 12) -> Completion:
    body = {"model": str(node.model_dir), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, "return_tokens_as_token_ids": True}
    if memory is not None:
        body["memory"] = memory
    request = urllib.request.Request(f"{node.base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        summary = json.loads(response.headers.get("x-inferscale-memory") or "{}")
        output = json.loads(response.read())
    choice = output["choices"][0]
    token_ids = [int(token.removeprefix("token_id:")) for token in choice["logprobs"]["tokens"]]
    return Completion(choice["text"], token_ids, choice["logprobs"]["token_logprobs"], output["usage"], summary)


_UPLOADS = itertools.count()


def upload_custom_kv(stub, profile: pb.KvProfile, user_id: str, make_kv, complete_stub=None) -> int:
    """Plays a worker for one user's facts: `make_kv(item) -> (keys, values, token_ids)`. Each upload gets a
    content id of its own (made-up KV is not a function of its tokens). Leases through `stub`, completes through
    `complete_stub` (default: the same); returns the facts accepted."""
    lease = stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="test", profile_id=profile.profile_id, max_facts=64))
    uploads = []
    for item in lease.items:
        if item.user_id != user_id:
            continue
        keys, values, token_ids = make_kv(item)
        header = KvBlobHeader(profile.profile_id, item.user_id, item.fact_id, item.version, "float32",
                              keys.shape[0], keys.shape[1], keys.shape[2], keys.shape[3], tuple(token_ids),
                              content_id(profile.profile_id, [next(_UPLOADS)], token_ids))
        uploads.append(pb.FactKvUpload(user_id=item.user_id, fact_id=item.fact_id, version=item.version,
                                       blob=encode_kv_blob(header, keys, values)))
    assert uploads, f"no leased facts of {user_id}"
    return (complete_stub or stub).CompleteKvWork(pb.CompleteKvWorkRequest(
        lease_id=lease.lease_id, worker_id="test", profile_id=profile.profile_id, results=uploads)).accepted


def random_kv(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (4, num_tokens, 2, 64)
    return torch.randn(shape, generator=generator) * 2, torch.randn(shape, generator=generator) * 2


@pytest.fixture
def node_plan_secret(monkeypatch) -> bytes:
    """The plan secret `python -m inference_node` hands its processes, for tests that build the middleware
    themselves."""
    secret = secrets.token_bytes(32)
    monkeypatch.setenv(PLAN_SECRET_ENV, secret.hex())
    return secret


@pytest.fixture
def neutralized(monkeypatch) -> list[str]:
    """Every text StoredTextGuard.neutral is asked to make neutral from here on in the test (clear it to start over)."""
    texts: list[str] = []
    neutral = StoredTextGuard.neutral

    def counting(guard: StoredTextGuard, text: str) -> str:
        texts.append(text)
        return neutral(guard, text)

    monkeypatch.setattr(StoredTextGuard, "neutral", counting)
    return texts


def kv_blob(key: KvKey, token_ids: tuple[int, ...], seed: int, storage_dtype: str = "bfloat16") -> bytes:
    keys, values = random_kv(len(token_ids), seed)
    header = KvBlobHeader(key.profile_id, key.user_id, key.fact_id, key.version, storage_dtype, *keys.shape[:1],
                          len(token_ids), keys.shape[2], keys.shape[3], token_ids, key.content_id)
    return encode_kv_blob(header, keys, values)


class KvStandIn(memory_pb2_grpc.MemoryServiceServicer):
    """Serves `blobs` by key as the real service frames them, through `tamper(key, blob)`, each call after `delay_s`;
    records each request."""

    def __init__(self, blobs: dict[KvKey, bytes]) -> None:
        self.blobs = blobs
        self.requests: list[pb.FetchKvRequest] = []
        self.tamper = lambda key, blob: blob
        self.refuse: grpc.StatusCode | None = None
        self.delay_s = 0.0

    def FetchKv(self, request, context):
        self.requests.append(request)
        time.sleep(self.delay_s)
        if self.refuse is not None:
            context.abort(self.refuse, "refused")
        keys = [KvKey(request.profile_id, HEADER_OWNER, HEADER_FACT_ID, HEADER_VERSION, request.header_content_id)
                ] if request.include_header else []
        keys += [KvKey(request.profile_id, request.user_id, ref.fact_id, ref.version, ref.content_id)
                 for ref in request.facts]
        for key in keys:
            blob = self.tamper(key, self.blobs.get(key, b""))
            yield pb.FetchKvResponse.FromString(fetch_kv_response_bytes(key, blob))


@pytest.fixture
def stand_in() -> Iterator[tuple[str, KvStandIn, list[ChunkLoad]]]:
    """A stand-in memory service serving a header and seven facts' KV (bf16, 4 layers x 2 heads x 64), its address
    and those chunks."""
    header = KvKey("prof", HEADER_OWNER, HEADER_FACT_ID, HEADER_VERSION, "a" * 32)
    chunks = [ChunkLoad(header, (1, 2, 3), 0)]
    for index in range(7):
        key = KvKey("prof", "stand-in-user", f"f{index}", 1, f"{index:032x}")
        chunks.append(ChunkLoad(key, tuple(range(10, 12 + index)), 0))
    servicer = KvStandIn({chunk.key: kv_blob(chunk.key, chunk.token_ids, index)
                         for index, chunk in enumerate(chunks)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_send_message_length", 64 << 20)])
    memory_pb2_grpc.add_MemoryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer, chunks
    finally:
        server.stop(None)


STORED_FACTS = [f"Fact number {index}: Quinn keeps {index + 2} goldfish in tank {index}." for index in range(9)]


def stored_chunks(stub, profile: pb.KvProfile, user_id: str) -> list[ChunkLoad]:
    """Stores STORED_FACTS with made-up KV for `user_id`; returns them as a node asks for them (named as
    RetrieveAndStage names them)."""
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
        pb.FactInput(fact_id=f"f{index}", text=text) for index, text in enumerate(STORED_FACTS)]))
    request = pb.RetrieveAndStageRequest(user_id=user_id, query="goldfish", profile=profile, node_id="kv-source",
                                         top_k=len(STORED_FACTS))
    stub.RetrieveAndStage(request)
    upload_custom_kv(stub, profile, user_id,
                     lambda item: (*random_kv(3 + int(item.fact_id[1:]), int(item.fact_id[1:])),
                                   list(range(100, 103 + int(item.fact_id[1:])))))
    retrieved = stub.RetrieveAndStage(request)
    assert all(fact.kv_ready for fact in retrieved.facts) and len(retrieved.facts) == len(STORED_FACTS)
    chunks, offset = [], 0
    for fact in sorted(retrieved.facts, key=lambda fact: fact.fact_id):
        chunks.append(ChunkLoad(KvKey(profile.profile_id, user_id, fact.fact_id, fact.version, fact.content_id),
                                tuple(fact.token_ids), offset))
        offset += len(fact.token_ids)
    return chunks
