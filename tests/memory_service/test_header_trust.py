"""Who may write a profile's memory header KV, through a real memory service with and without --auth-file, and the
real worker on the tiny Llama.

Regression (issue 31, the table's first row): an AnnounceProfile with role NODE carrying a `header_kv` blob (the real
header's token ids and content id, made-up tensors) was accepted, with the node's credential or, without access
control, from any caller; the first header stored won, so a real worker's header was ignored afterwards and every
node of the profile injected the planted one for every user. Now KV comes from workers only: the planted header is
refused, and the header served afterwards (RetrieveAndStage's header_content_id, FetchKv's bytes) is the worker's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.blob import KvBlobHeader, encode_kv_blob
from inferscale_kv.call_credentials import WORKER_TOKEN_ENV
from inferscale_kv.kv_key import header_key
from inferscale_kv.layout import memory_header_ids
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
from memory_service.access import token_digest
from precompute_worker.encoder import FactEncoder
from precompute_worker.worker import PrecomputeWorker, profile_message
from tests.conftest import run_worker

TOKENS = {"nodes": "node-secret", "workers": "worker-secret", "acme": "acme-secret"}
CREDENTIALS = [
    {"name": "nodes", "role": "node", "token_sha256": token_digest(TOKENS["nodes"])},
    {"name": "workers", "role": "worker", "token_sha256": token_digest(TOKENS["workers"])},
    {"name": "acme", "role": "app", "user_prefix": "acme/", "token_sha256": token_digest(TOKENS["acme"])},
]
USER = "acme/maya"
WORKER_ID = "real-worker"


def _metadata(name: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[name]}"),) if name else ()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def profile(tiny_llama_dir: Path, tokenizer) -> pb.KvProfile:
    """The profile the real worker computes (its defaults)."""
    return profile_message(build_model_profile(tiny_llama_dir, tokenizer, "float32", DEFAULT_CONTEXT_WINDOW))


@pytest.fixture(scope="module")
def planted_header(profile: pb.KvProfile, tokenizer) -> bytes:
    """The real header's token ids and content id, with made-up tensors of the tiny Llama's shape."""
    ids = memory_header_ids(tokenizer)
    key = header_key(profile.profile_id, ids)
    generator = torch.Generator().manual_seed(31)
    keys, values = (torch.randn((4, len(ids), 2, 64), generator=generator) for _ in range(2))
    return encode_kv_blob(KvBlobHeader(profile.profile_id, key.user_id, key.fact_id, key.version, "float32", 4,
                                       len(ids), 2, 64, tuple(ids), key.content_id), keys, values)


@pytest.fixture(scope="module")
def workers_header(tiny_llama_dir: Path, tokenizer, profile: pb.KvProfile) -> bytes:
    """The header blob `python -m precompute_worker` computes on this machine (the same code, model and input)."""
    ids = memory_header_ids(tokenizer)
    worker = PrecomputeWorker(None, FactEncoder.from_pretrained(tiny_llama_dir), tokenizer, ids,
                              build_model_profile(tiny_llama_dir, tokenizer, "float32", DEFAULT_CONTEXT_WINDOW),
                              WORKER_ID)
    return worker.header_blob()


@pytest.fixture(scope="module", params=["open", "auth-file"])
def service(request, tmp_path_factory) -> Iterator[tuple[MemoryServiceProcess, bool]]:
    root = tmp_path_factory.mktemp(f"header-trust-{request.param}")
    arguments: list[str] = []
    if request.param == "auth-file":
        (root / "credentials.json").write_text(json.dumps({"credentials": CREDENTIALS}))
        arguments = ["--auth-file", str(root / "credentials.json")]
    process = MemoryServiceProcess(root / "data", root / "service.log", *arguments).start()
    yield process, request.param == "auth-file"
    process.stop()


def _announce(stub, profile: pb.KvProfile, header: bytes, role: int, credential: str | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=role, announcer_id="node-1",
                                                       header_kv=header), metadata=_metadata(credential))
    return raised.value


def test_a_planted_header_is_refused_and_the_real_workers_header_is_served(service, profile, planted_header,
                                                                           workers_header, tiny_llama_dir,
                                                                           monkeypatch) -> None:
    process, guarded = service
    app, node, worker = ("acme", "nodes", "workers") if guarded else (None, None, None)
    with process.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        stub.IngestFacts(pb.IngestFactsRequest(user_id=USER, facts=[pb.FactInput(text="Maya keeps bees.")]),
                         metadata=_metadata(app))

        refused = _announce(stub, profile, planted_header, pb.PROFILE_ROLE_NODE, node)
        expected = grpc.StatusCode.PERMISSION_DENIED if guarded else grpc.StatusCode.INVALID_ARGUMENT
        assert refused.code() == expected, refused.details()
        assert "header_kv" in refused.details() and "upload" in refused.details()
        for role in (pb.PROFILE_ROLE_UNSPECIFIED, pb.PROFILE_ROLE_WORKER):  # the node's credential, any role
            if guarded:
                assert _announce(stub, profile, planted_header, role, node).code() == \
                    grpc.StatusCode.PERMISSION_DENIED
        if guarded:  # nor an app, nor a worker declaring itself a node
            assert _announce(stub, profile, planted_header, pb.PROFILE_ROLE_WORKER, app).code() == \
                grpc.StatusCode.PERMISSION_DENIED
            assert _announce(stub, profile, planted_header, pb.PROFILE_ROLE_NODE, worker).code() == \
                grpc.StatusCode.INVALID_ARGUMENT

        if guarded:
            monkeypatch.setenv(WORKER_TOKEN_ENV, TOKENS["workers"])
        run_worker(process, tiny_llama_dir, "--worker-id", WORKER_ID)
        retrieved = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
            user_id=USER, query="bees", top_k=3, profile=profile, node_id="node-1"), metadata=_metadata(node))
        assert retrieved.header_content_id and all(fact.kv_ready for fact in retrieved.facts)
        (reply,) = stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id, user_id=USER, include_header=True,
                                                  header_content_id=retrieved.header_content_id),
                                metadata=_metadata(node))
        assert reply.blob == workers_header and reply.blob != planted_header
