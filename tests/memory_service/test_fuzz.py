"""Fuzzing every RPC of a real memory service with generated messages (hypothesis): oversize, empty and unicode-edge
fields, wrong ids, huge and negative numbers, malformed batches and KV blobs, and now and then the names of real
profiles, facts and KV. Every call must end in OK or a clear client-error status with a message (never INTERNAL or
UNKNOWN); a rejected call must change nothing (the named user's facts, the service's counts, every table of the
coordination store); no answer may carry another user's facts or KV (each user's facts carry a marker naming it);
the service must stay up and a bystander user's facts must survive the whole run.

`make test` runs CASES_PER_RPC generated calls per RPC; INFERSCALE_FUZZ_CASES sets another count (`make test-fuzz`:
10,000 per RPC)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.blob import KvBlobHeader, encode_kv_blob, read_kv_header
from inferscale_kv.kv_key import HEADER_OWNER, content_id, header_key
from inferscale_kv.layout import token_hash
from inferscale_kv.profile import kv_profile_id
from tests.conftest import own_memory_service

CASES_PER_RPC = int(os.environ.get("INFERSCALE_FUZZ_CASES", "60"))
# PERMISSION_DENIED even without access control: a CompleteKvWork under a lease not given to its worker_id.
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS,
                 grpc.StatusCode.PERMISSION_DENIED}
BYSTANDER = "fuzz-bystander"
USERS = ("fuzz-a", "fuzz-b", "fuzz-c")
MARKED = (*USERS, BYSTANDER)
CASES: Counter[str] = Counter()
OUTCOMES: Counter[str] = Counter()
SECONDS: Counter[str] = Counter()
ACCEPTED: Counter[str] = Counter()
COORDINATION_TABLES = ("profiles", "jobs", "kv_entries", "kv_audits", "kv_exclusions", "kv_quarantine", "workers",
                       "user_generations", "version_floors", "store_meta")


def _marker(user_id: str) -> str:
    return f"[owner {user_id}]"


# A profile whose KV the users hold (uploaded by the test as its worker), named now and then by generated calls.
HEADER_IDS = (1, 2, 3)
PROFILE = pb.KvProfile(model="fuzz-model", model_hash="mh", kv_dtype="float32", tokenizer_hash="th",
                       header_hash=token_hash(HEADER_IDS), recipe="chunked-rope-cwe", recipe_version=1,
                       context_window=0)
PROFILE.profile_id = kv_profile_id(PROFILE)
FACT_TOKENS = (11, 12, 13)
FACT_CONTENT_ID = content_id(PROFILE.profile_id, HEADER_IDS, FACT_TOKENS)
HEADER_CONTENT_ID = header_key(PROFILE.profile_id, HEADER_IDS).content_id


def _blob(user_id: str, fact_id: str, version: int, cid: str, tokens=FACT_TOKENS, dtype: str = "float32",
          fill: float = 0.5, layers: int = 2) -> bytes:
    header = KvBlobHeader(PROFILE.profile_id, user_id, fact_id, version, dtype, layers, len(tokens), 1, 4,
                          tuple(tokens), cid)
    keys = torch.full((layers, len(tokens), 1, 4), fill)
    return encode_kv_blob(header, keys, keys)


# Unicode edges: NUL and control characters, bidi marks, combining marks, astral emoji; never lone surrogates
# (protobuf cannot carry them, so no client can send them).
edgy_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40) | st.sampled_from(
    ["", " ", "\x00", "\u202e\u2066", "e\u0301\u0301\u0301", "😀" * 20, "a/../b", "'; DROP TABLE facts; --",
     "user\nid", "\ufeff", HEADER_OWNER, "header", "marker"])
oversize_text = st.integers(min_value=1_000, max_value=300_000).map(lambda size: "x" * size)


def mostly(plausible: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """Plausible values three times in four, so that many calls pass validation and reach the deeper paths."""
    return st.integers(min_value=0, max_value=3).flatmap(lambda pick: hostile if pick == 3 else plausible)


plain_text = st.text(alphabet=st.characters(categories=["L", "N", "P", "Zs"]), min_size=1, max_size=60).filter(
    str.strip)
plain_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+/=-]{0,20}", fullmatch=True)
any_text = mostly(plain_text, edgy_text | oversize_text)
any_id = mostly(plain_ids, edgy_text)
optional_id = mostly(st.just("") | plain_ids, edgy_text)
any_int32 = mostly(st.integers(min_value=0, max_value=50), st.integers(min_value=-(2**31), max_value=2**31 - 1))
any_int64 = mostly(st.integers(min_value=0, max_value=50), st.integers(min_value=-(2**63), max_value=2**63 - 1))
user_ids = mostly(st.sampled_from(USERS), edgy_text.filter(lambda user: user != BYSTANDER))
timestamps = mostly(st.builds(Timestamp, seconds=st.integers(min_value=0, max_value=2**33)), st.builds(
    Timestamp, seconds=st.integers(min_value=-(2**40), max_value=2**40),
    nanos=st.integers(min_value=0, max_value=999_999_999)))
metadata = mostly(st.dictionaries(plain_ids, plain_text, max_size=3),
                  st.dictionaries(edgy_text, edgy_text | oversize_text, max_size=40))
fact_inputs = st.builds(pb.FactInput, fact_id=optional_id, text=any_text, source_turn_id=optional_id,
                        timestamp=timestamps, metadata=metadata)
# Batches: a few generated facts, or a great many copies (past the batch limit).
fact_batches = mostly(st.lists(fact_inputs, min_size=1, max_size=6), st.lists(fact_inputs, max_size=6) | st.integers(
    min_value=0, max_value=20_000).map(lambda size: [pb.FactInput(text=f"fact {index}") for index in range(size)]))
turns = st.builds(pb.Turn, turn_id=any_id, seq=any_int64, session_id=optional_id, speaker=mostly(plain_text, any_text),
                  text=any_text, timestamp=timestamps)
profiles = st.just(PROFILE) | st.builds(
    pb.KvProfile, profile_id=edgy_text | st.just(PROFILE.profile_id), model=any_text, model_hash=edgy_text,
    kv_dtype=edgy_text | st.sampled_from(["float32", "fp8_e4m3"]), tokenizer_hash=edgy_text, header_hash=edgy_text,
    recipe=edgy_text, recipe_version=any_int32, context_window=any_int32)
profile_ids = edgy_text | st.just(PROFILE.profile_id)
fact_ids = st.lists(any_id | st.just("marker"), max_size=6) | st.integers(min_value=0, max_value=50_000).map(
    lambda size: [f"id-{index}" for index in range(size)])
content_ids = edgy_text | st.sampled_from([FACT_CONTENT_ID, HEADER_CONTENT_ID])
# KV blobs: random bytes, or well-formed blobs naming real or made-up profiles, users, facts, dtypes, shapes, values.
blobs = st.binary(max_size=512) | st.builds(
    _blob, user_id=user_ids, fact_id=any_id | st.just("marker"), version=any_int64,
    cid=content_ids | st.just("0" * 32), tokens=st.lists(st.integers(-5, 2**32), min_size=1, max_size=4).map(tuple),
    dtype=st.sampled_from(["float32", "bfloat16", "fp8_e4m3"]),
    fill=st.sampled_from([0.5, float("nan"), float("inf"), 1e30]), layers=st.integers(1, 3))
header_blobs = blobs | st.builds(_blob, user_id=st.just(HEADER_OWNER), fact_id=st.just("header"), version=st.just(1),
                                 cid=st.just(HEADER_CONTENT_ID), tokens=st.just(HEADER_IDS),
                                 fill=st.sampled_from([0.5, 0.25, float("nan")]))

REQUESTS = {
    "IngestFacts": st.builds(pb.IngestFactsRequest, user_id=user_ids, facts=fact_batches, request_id=any_id),
    "IngestTurns": st.builds(pb.IngestTurnsRequest, user_id=user_ids, turns=st.lists(turns, max_size=3)),
    "SearchFacts": st.builds(pb.SearchFactsRequest, user_id=user_ids, query=any_text, top_k=any_int32),
    "ListFacts": st.builds(pb.ListFactsRequest, user_id=user_ids, page_size=any_int32,
                           page_token=mostly(st.just(""), any_text)),
    "DeleteFacts": st.builds(pb.DeleteFactsRequest, user_id=user_ids, fact_ids=fact_ids),
    "DeleteUser": st.builds(pb.DeleteUserRequest, user_id=user_ids),
    "GetStats": st.builds(pb.GetStatsRequest, user_id=user_ids),
    "RetrieveAndStage": st.builds(pb.RetrieveAndStageRequest, user_id=user_ids, query=any_text, top_k=any_int32,
                                  profile=profiles, node_id=any_id),
    "RetrieveAndStageBatch": st.builds(pb.RetrieveAndStageBatchRequest, calls=st.lists(
        st.builds(pb.RetrieveAndStageRequest, user_id=user_ids, query=any_text, top_k=any_int32, profile=profiles,
                  node_id=any_id), max_size=3)),
    "AnnounceProfile": st.builds(pb.AnnounceProfileRequest, profile=profiles, role=st.integers(0, 5),
                                 announcer_id=any_id, header_kv=header_blobs | st.just(b"")),
    "LeaseKvWork": st.builds(pb.LeaseKvWorkRequest, worker_id=any_id, profile_id=profile_ids, max_facts=any_int32,
                             lease_seconds=any_int32),
    "CompleteKvWork": st.builds(
        pb.CompleteKvWorkRequest, lease_id=edgy_text, worker_id=any_id, profile_id=profile_ids,
        results=st.lists(st.builds(pb.FactKvUpload, user_id=user_ids, fact_id=any_id, version=any_int64,
                                   blob=blobs), max_size=4),
        failures=st.lists(st.builds(pb.FactKvFailure, user_id=user_ids, fact_id=any_id, version=any_int64,
                                    error=any_text), max_size=2)),
    "FetchKv": st.builds(pb.FetchKvRequest, profile_id=profile_ids, user_id=user_ids,
                         facts=st.lists(st.builds(pb.FactRef, fact_id=any_id | st.just("marker"),
                                                  version=any_int64 | st.just(1), content_id=content_ids),
                                        max_size=5),
                         include_header=st.booleans(), header_content_id=content_ids),
}


@dataclass
class Fuzzed:
    """The service under fuzzing, and the store state the last call left (what a rejected call must not change)."""

    service: MemoryServiceProcess
    stub: object
    state: str = ""


def _facts_of(stub, user_id: str) -> list[tuple[str, int, str]] | None:
    """The user's facts, or None when the id itself is one the service refuses."""
    try:
        listed = stub.ListFacts(pb.ListFactsRequest(user_id=user_id, page_size=1000), timeout=30)
    except grpc.RpcError:
        return None
    return sorted((fact.fact_id, fact.version, fact.text) for fact in listed.facts)


def _store_state(fuzzed: Fuzzed) -> str:
    """A digest of every coordination table, read from its SQLite file: profiles, KV work, KV index, audits, workers,
    and each user's write generation, which every write of facts or turns moves (memory_service.user_writes)."""
    digest = hashlib.sha256()
    path = Path(fuzzed.service.data_dir) / "kv" / "index.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as database:
        for table in COORDINATION_TABLES:
            digest.update(repr(sorted(database.execute(f"SELECT * FROM {table}").fetchall())).encode())
    database.close()
    return digest.hexdigest()


def _leaks(method: str, request, response) -> list[str]:
    """What in an OK answer belongs to another user than the one the request names."""
    user_id = getattr(request, "user_id", "")
    foreign = [_marker(user) for user in MARKED if user != user_id]
    texts: list[str] = []
    owners: list[str] = []
    if method in ("SearchFacts", "ListFacts"):
        facts = [scored.fact for scored in response.facts] if method == "SearchFacts" else list(response.facts)
        texts = [fact.text for fact in facts]
        owners = [fact.user_id for fact in facts]
    elif method == "RetrieveAndStage":
        texts = [fact.text for fact in response.facts]
    elif method == "RetrieveAndStageBatch":
        return [leak for call, result in zip(request.calls, response.results, strict=True) if result.code == 0
                for leak in _leaks("RetrieveAndStage", call, result.response)]
    elif method == "FetchKv":
        owners = [read_kv_header(reply.blob).user_id for reply in response if reply.blob]
        owners = [owner for owner in owners if owner != HEADER_OWNER]
    elif method == "LeaseKvWork":
        return []  # workers see every user's facts by nature
    return [text for text in texts if any(marker in text for marker in foreign)] + [
        owner for owner in owners if owner != user_id]


def _call(stub, method: str, request) -> tuple[grpc.StatusCode, object]:
    try:
        response = getattr(stub, method)(request, timeout=60)
        if method == "FetchKv":
            response = list(response)
    except grpc.RpcError as error:
        assert error.code() in CLIENT_ERRORS, f"{method}: {error.code().name}: {error.details()}"
        assert error.details(), f"{method}: {error.code().name} without a message"
        return error.code(), None
    return grpc.StatusCode.OK, response


def _ensure_markers(stub) -> None:
    """Each user holds a fact carrying its marker (fuzzed deletes may have removed it)."""
    for user in MARKED:
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[
            pb.FactInput(fact_id="marker", text=f"{_marker(user)} keeps bees.")]), timeout=60)


def _upload_kv(stub) -> None:
    """Plays the profile's worker: its header, and KV of every fact it leases."""
    key = header_key(PROFILE.profile_id, HEADER_IDS)
    stub.AnnounceProfile(pb.AnnounceProfileRequest(
        profile=PROFILE, role=pb.PROFILE_ROLE_WORKER, announcer_id="fuzz-worker",
        header_kv=_blob(HEADER_OWNER, key.fact_id, key.version, key.content_id, tokens=HEADER_IDS)))
    while (lease := stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="fuzz-worker", profile_id=PROFILE.profile_id,
                                                           max_facts=64))).items:
        stub.CompleteKvWork(pb.CompleteKvWorkRequest(
            lease_id=lease.lease_id, worker_id="fuzz-worker", profile_id=PROFILE.profile_id, results=[
                pb.FactKvUpload(user_id=item.user_id, fact_id=item.fact_id, version=item.version,
                                blob=_blob(item.user_id, item.fact_id, item.version, FACT_CONTENT_ID))
                for item in lease.items]))


MAX_FACTS_PER_USER = 200  # the users' facts are listed twice per call: they must not grow without bound


@pytest.fixture(scope="module")
def memory_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemoryServiceProcess]:
    """A service of this module's own: its checks compare whole-store states around each generated call."""
    with own_memory_service(tmp_path_factory, "fuzz", "--max-facts-per-user", str(MAX_FACTS_PER_USER)) as service:
        yield service


@pytest.fixture(scope="module")
def fuzzed(memory_service, stub) -> Iterator[Fuzzed]:
    _ensure_markers(stub)
    stub.IngestFacts(pb.IngestFactsRequest(user_id=BYSTANDER, facts=[pb.FactInput(fact_id="b2",
                                                                                  text="The bystander rows.")]))
    _upload_kv(stub)
    ready = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=USERS[0], query="bees", top_k=5,
                                                             profile=PROFILE, node_id="n"))
    assert ready.header_content_id == HEADER_CONTENT_ID and any(fact.kv_ready for fact in ready.facts)
    yield Fuzzed(memory_service, stub)


@pytest.fixture(scope="module")
def bystander_facts(fuzzed) -> list[tuple[str, int, str]]:
    facts = _facts_of(fuzzed.stub, BYSTANDER)
    assert facts is not None and len(facts) == 2
    return facts


@pytest.mark.parametrize("method", sorted(REQUESTS))
def test_fuzzed_calls_end_in_a_clear_status_and_a_rejected_one_changes_nothing(method, fuzzed, bystander_facts):
    stub = fuzzed.stub
    _ensure_markers(stub)
    fuzzed.state = _store_state(fuzzed)
    started = time.perf_counter()

    @settings(max_examples=CASES_PER_RPC, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(request=REQUESTS[method])
    def one_case(request) -> None:
        user_id = getattr(request, "user_id", None)
        before = _facts_of(stub, user_id) if user_id is not None else None
        code, response = _call(stub, method, request)
        CASES[method] += 1
        OUTCOMES[code.name] += 1
        ACCEPTED[method] += code == grpc.StatusCode.OK
        state = _store_state(fuzzed)
        if code == grpc.StatusCode.OK:
            assert not _leaks(method, request, response), f"{method} answered another user's data"
        else:
            assert state == fuzzed.state, f"{method} was rejected ({code.name}) but changed the store"
            if before is not None:
                assert _facts_of(stub, user_id) == before, f"{method} was rejected ({code.name}) but changed " \
                                                           f"{user_id!r}"
        fuzzed.state = state

    one_case()
    SECONDS[method] += time.perf_counter() - started
    assert CASES[method] >= CASES_PER_RPC


def test_after_fuzzing_the_service_serves_and_the_bystander_lost_nothing(fuzzed, bystander_facts):
    assert fuzzed.service.process.poll() is None
    with fuzzed.service.channel() as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert _facts_of(fuzzed.stub, BYSTANDER) == bystander_facts
    print(f"\nfuzzed {sum(CASES.values())} calls over {len(CASES)} RPCs in {sum(SECONDS.values()):.0f} s; "
          f"outcomes: {dict(OUTCOMES)}")
    for method in sorted(CASES):
        print(f"  {method}: {CASES[method]} calls ({ACCEPTED[method]} OK), {SECONDS[method]:.1f} s")
