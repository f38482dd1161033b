"""Who may write a profile's memory header KV, through a real memory service with and without --auth-file, and the
real worker on the tiny Llama.

Regression (issue 31, the table's first row): an AnnounceProfile with role NODE carrying a `header_kv` blob (the real
header's token ids and content id, made-up tensors) was accepted, with the node's credential or, without access
control, from any caller; the first header stored won, so a real worker's header was ignored afterwards and every
node of the profile injected the planted one for every user. Now KV comes from workers only: the planted header is
refused, and the header served afterwards (RetrieveAndStage's header_content_id, FetchKv's bytes) is the worker's."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.blob import KvBlobHeader, decode_kv_blob, encode_kv_blob
from inferscale_kv.call_credentials import WORKER_TOKEN_ENV
from inferscale_kv.kv_key import content_id, header_key
from inferscale_kv.layout import fact_token_ids, memory_header_ids
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
from memory_service.access import token_digest
from memory_service.kv_checks import kv_difference
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
WORKER_ID = "workers/real-worker"  # with access control on: its credential's name, then the process


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


# Two worker credentials: a hostile worker holds one of them.
AUDIT_TOKENS = {**TOKENS, "workers-b": "worker-b-secret"}
AUDIT_CREDENTIALS = [*CREDENTIALS, {"name": "workers-b", "role": "worker",
                                    "token_sha256": token_digest(AUDIT_TOKENS["workers-b"])}]


def _as(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {AUDIT_TOKENS[name]}"),)


@pytest.fixture(scope="module")
def audited_service(tmp_path_factory) -> Iterator[MemoryServiceProcess]:
    """Access control on, two worker credentials, every new fact KV audited."""
    root = tmp_path_factory.mktemp("header-trust-audit")
    (root / "credentials.json").write_text(json.dumps({"credentials": AUDIT_CREDENTIALS}))
    process = MemoryServiceProcess(root / "data", root / "service.log", "--auth-file", str(root / "credentials.json"),
                                   "--kv-audit-share", "1").start()
    yield process
    process.stop()


def _audit_outcomes(service: MemoryServiceProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {outcome: float(count) for outcome, count in
            re.findall(r'^inferscale_kv_audits_total\{outcome="(\w+)"\} (\S+)$', text, re.MULTILINE)
            if float(count)}


def _announce_header(stub, profile: pb.KvProfile, header: bytes, announcer_id: str, credential: str) -> None:
    stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER,
                                                   announcer_id=announcer_id, header_kv=header),
                         metadata=_as(credential))


def _lease(stub, profile: pb.KvProfile, worker_id: str, credential: str) -> pb.LeaseKvWorkResponse:
    return stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id=worker_id, profile_id=profile.profile_id),
                            metadata=_as(credential))


def test_a_worker_credential_cannot_claim_another_workers_id(audited_service, profile, planted_header) -> None:
    """Regression (issue 31 review, C1): worker_id and announcer_id were taken as the request claimed them."""
    with audited_service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        calls = [lambda: _announce_header(stub, profile, planted_header, "evil-1", "workers"),
                 lambda: _lease(stub, profile, "workers-b", "workers"),
                 lambda: stub.CompleteKvWork(pb.CompleteKvWorkRequest(lease_id="x", worker_id="evil-2",
                                                                      profile_id=profile.profile_id),
                                             metadata=_as("workers"))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as raised:
                call()
            assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED, raised.value.details()
            assert "is not credential 'workers'" in raised.value.details()


def test_one_worker_credential_never_audits_its_own_header_or_fact_kv(audited_service, profile, planted_header,
                                                                      tokenizer) -> None:
    """Regression (issue 31 review, C1): one worker credential stored a poisoned header as `evil-1`, leased as
    `evil-2` (asked for the header: "another worker") and announced the same blob again: the audit matched, and the
    header was served to every user, never audited again. The same held for fact KV. Now both processes of one
    credential are one worker to the audit; a worker of another credential audits."""
    with audited_service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        _announce_header(stub, profile, planted_header, "workers/evil-1", "workers")
        assert not _lease(stub, profile, "workers/evil-2", "workers").header_kv_wanted
        _announce_header(stub, profile, planted_header, "workers/evil-2", "workers")
        assert _audit_outcomes(audited_service) == {}
        assert _lease(stub, profile, "workers-b", "workers-b").header_kv_wanted  # the audit still waits for it

        stub.IngestFacts(pb.IngestFactsRequest(user_id=USER, facts=[pb.FactInput(fact_id="bees",
                                                                                 text="Maya keeps bees.")]),
                         metadata=_metadata("acme"))
        lease = _lease(stub, profile, "workers/evil-1", "workers")
        (item,) = [item for item in lease.items if item.fact_id == "bees"]
        header_ids = memory_header_ids(tokenizer)
        tokens = fact_token_ids(tokenizer, item.text)
        keys, values = (torch.randn((4, len(tokens), 2, 64), generator=torch.Generator().manual_seed(1))
                        for _ in range(2))
        blob = encode_kv_blob(KvBlobHeader(profile.profile_id, USER, item.fact_id, item.version, "float32", 4,
                                           len(tokens), 2, 64, tuple(tokens),
                                           content_id(profile.profile_id, header_ids, tokens)), keys, values)
        upload = pb.FactKvUpload(user_id=USER, fact_id=item.fact_id, version=item.version, blob=blob)
        assert stub.CompleteKvWork(pb.CompleteKvWorkRequest(lease_id=lease.lease_id, worker_id="workers/evil-1",
                                                            profile_id=profile.profile_id, results=[upload]),
                                   metadata=_as("workers")).accepted == 1
        assert not _lease(stub, profile, "workers/evil-2", "workers").items  # its own KV: not its audit
        assert [i.fact_id for i in _lease(stub, profile, "workers-b/1", "workers-b").items] == ["bees"]


def _made_up_upload(profile: pb.KvProfile, tokenizer, item: pb.KvWorkItem, seed: int) -> pb.FactKvUpload:
    """KV of a leased fact under its true names (token ids, content id), with made-up tensors of the model's shape."""
    tokens = fact_token_ids(tokenizer, item.text)
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn((4, len(tokens), 2, 64), generator=generator) for _ in range(2))
    header = KvBlobHeader(profile.profile_id, item.user_id, item.fact_id, item.version, "float32", 4, len(tokens), 2,
                          64, tuple(tokens), content_id(profile.profile_id, memory_header_ids(tokenizer), tokens))
    return pb.FactKvUpload(user_id=item.user_id, fact_id=item.fact_id, version=item.version,
                           blob=encode_kv_blob(header, keys, values))


def _metric(service: MemoryServiceProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10) as response:
        found = re.search(rf"^{name} (\S+)$", response.read().decode(), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_worker_cannot_complete_another_workers_lease(audited_service, profile, tokenizer) -> None:
    """Regression (issue 43, the table's first row): credential workers-b completed workers' lease (its own
    worker_id, the other's lease_id, made-up KV for the other's fact) and the bytes were stored and served. Lease ids
    were logged at info level, so anyone reading the log could do the same. Now a lease is completed only by the
    identity it was given to: anything else is PERMISSION_DENIED, stores nothing and is counted."""
    user = "acme/ines"
    with audited_service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER,
                                                       announcer_id="workers-b"), metadata=_as("workers-b"))
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[pb.FactInput(fact_id="kayak",
                                                                                 text="Ines paddles a kayak.")]),
                         metadata=_metadata("acme"))
        lease = _lease(stub, profile, "workers/a", "workers")
        (item,) = [item for item in lease.items if item.user_id == user]
        before = _metric(audited_service, "inferscale_kv_foreign_lease_completions_total")
        for lease_id in (lease.lease_id, "never-issued", "0" * 31 + "\0", "f" * 32):
            with pytest.raises(grpc.RpcError) as raised:
                stub.CompleteKvWork(pb.CompleteKvWorkRequest(
                    lease_id=lease_id, worker_id="workers-b", profile_id=profile.profile_id,
                    results=[_made_up_upload(profile, tokenizer, item, seed=43)]), metadata=_as("workers-b"))
            assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED, raised.value.details()
            assert "lease_id" in raised.value.details()
        assert _metric(audited_service, "inferscale_kv_foreign_lease_completions_total") == before + 4
        with pytest.raises(grpc.RpcError) as raised:  # a failure must name a valid user and fact
            stub.CompleteKvWork(pb.CompleteKvWorkRequest(
                lease_id=lease.lease_id, worker_id="workers/a", profile_id=profile.profile_id,
                failures=[pb.FactKvFailure(user_id="\0", fact_id=item.fact_id, version=item.version, error="x")]),
                metadata=_as("workers"))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("failures[0].user_id")

        def retrieved() -> pb.RetrievedFact:
            response = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
                user_id=user, query="kayak", top_k=1, profile=profile, node_id="n1"), metadata=_metadata("nodes"))
            return response.facts[0]

        assert not retrieved().kv_ready
        # The lease is still its holder's: its own completion is stored.
        assert stub.CompleteKvWork(pb.CompleteKvWorkRequest(
            lease_id=lease.lease_id, worker_id="workers/a", profile_id=profile.profile_id,
            results=[_made_up_upload(profile, tokenizer, item, seed=1)]), metadata=_as("workers")).accepted == 1
        assert retrieved().kv_ready
    assert lease.lease_id not in Path(audited_service.log_path).read_text()


WITNESS_TOKENS = {**TOKENS, **{f"workers-{name}": f"worker-{name}-secret" for name in "abcd"}}
WITNESS_CREDENTIALS = [*CREDENTIALS[:1], *CREDENTIALS[2:], *(
    {"name": f"workers-{name}", "role": "worker", "token_sha256": token_digest(WITNESS_TOKENS[f"workers-{name}"])}
    for name in "abcd")]


@pytest.fixture(scope="module", params=["one-witness", "two-witness"])
def witnessed_service(request, tmp_path_factory) -> Iterator[tuple[MemoryServiceProcess, bool]]:
    """Four worker credentials (a service that asks two of them to agree on a header), or none (one witness)."""
    root = tmp_path_factory.mktemp(f"header-witnesses-{request.param}")
    arguments: list[str] = []
    if request.param == "two-witness":
        (root / "credentials.json").write_text(json.dumps({"credentials": WITNESS_CREDENTIALS}))
        arguments = ["--auth-file", str(root / "credentials.json")]
    process = MemoryServiceProcess(root / "data", root / "service.log", *arguments).start()
    yield process, request.param == "two-witness"
    process.stop()


def test_a_header_is_served_only_once_two_workers_agree_on_it(witnessed_service, profile, workers_header,
                                                              planted_header) -> None:
    """Regression (issue 43, the table's second row): three workers announced three different headers for one
    profile, the first honest; at the third, the stored honest header was withdrawn and the third stored, though no
    other worker agreed with it, and every user's kv answer changed. Now no header one worker alone vouches for
    replaces another: the memory is served as text (no header_content_id: the node prefills the text) until two
    workers agree, and the header they agree on is served. With several worker credentials, a new profile's first
    header waits for a second credential's too."""
    service, two_witness = witnessed_service
    user = "acme/ana"

    def as_worker(name: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {WITNESS_TOKENS[name]}"),) if two_witness else ()

    def announce(name: str, header: bytes) -> None:
        stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER,
                                                       announcer_id=name, header_kv=header), metadata=as_worker(name))

    def served() -> bytes:
        node = (("authorization", f"Bearer {TOKENS['nodes']}"),) if two_witness else ()
        response = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=user, query="boat", top_k=1,
                                                                    profile=profile, node_id="n1"), metadata=node)
        if not response.header_content_id:
            return b""
        (reply,) = stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id, user_id=user, include_header=True,
                                                  header_content_id=response.header_content_id), metadata=node)
        return reply.blob

    def header_wanted(name: str) -> bool:
        return stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id=name, profile_id=profile.profile_id),
                                metadata=as_worker(name)).header_kv_wanted

    honest = decode_kv_blob(workers_header)
    other = encode_kv_blob(honest.header, honest.keys + 0.5, honest.values)  # neither the honest nor the planted one
    with service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[pb.FactInput(text="Ana sails a boat.")]),
                         metadata=(("authorization", f"Bearer {TOKENS['acme']}"),) if two_witness else ())
        announce("workers-a", workers_header)
        assert served() == (b"" if two_witness else workers_header)  # several credentials: one alone is not enough
        announce("workers-b", planted_header)
        announce("workers-c", other)
        assert served() == b""  # no two workers agree: text, never a header one worker alone vouches for
        assert header_wanted("workers-d")
        announce("workers-d", workers_header)  # agrees with workers-a
        assert kv_difference(served(), workers_header) == 0.0
        for name in "abcd":  # settled: nobody is asked again, and the outvoted are barred
            assert not header_wanted(f"workers-{name}")
        announce("workers-b", planted_header)
        announce("workers-c", planted_header)  # even two barred workers that agree replace nothing
        assert kv_difference(served(), workers_header) == 0.0
    assert _metric(service, "inferscale_kv_profiles_awaiting_header") == 0
