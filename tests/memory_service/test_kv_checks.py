"""What the service checks of uploaded KV, through a real memory service with workers played by the test: a header
must be the profile's (its token ids hash to header_hash), every blob must be stored as the profile's kv_dtype, laid
out as the profile's stored KV and hold finite values; a rejected upload stores nothing. A header that differs from
the stored one beyond the dtype's tolerance is a loud conflict (counted, logged with both workers). A stored header a
second worker confirmed stays served, the differing one kept aside and its worker refused for that header from then on.
One no second worker confirmed is withdrawn: both become candidates, the memory is served as text, and the first
header another worker agrees with is stored, the workers whose candidates differed barred. (This service runs
without access control: a one-witness service, whose first header is served until disputed.)"""

from __future__ import annotations

import json
import re
import sqlite3
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.blob import KvBlobHeader, decode_kv_blob, encode_kv_blob
from inferscale_kv.kv_key import content_id, header_key
from inferscale_kv.layout import token_hash
from inferscale_kv.profile import kv_profile_id
from memory_service.kv_checks import kv_difference
from tests.stacks import UNAUDITED, ServerPool, Users

CHECKS_USER = Users(__name__)("checks-user")
HEADER_IDS = (5, 6, 7, 8)
LAYERS, HEADS, DIM = 2, 2, 4


@pytest.fixture(scope="module")
def memory_service(servers: ServerPool) -> MemoryServiceProcess:
    """The session's service without the sampled audit (the uploads here are made up)."""
    return servers.memory_service(*UNAUDITED)


def _profile(model: str, kv_dtype: str = "float32") -> pb.KvProfile:
    profile = pb.KvProfile(model=model, model_hash="mh", kv_dtype=kv_dtype, tokenizer_hash="th",
                           header_hash=token_hash(HEADER_IDS), recipe="chunked-rope-cwe", recipe_version=1,
                           context_window=0)
    profile.profile_id = kv_profile_id(profile)
    return profile


def _tensors(tokens: int, seed: int, layers: int = LAYERS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn((layers, tokens, HEADS, DIM), generator=generator),
            torch.randn((layers, tokens, HEADS, DIM), generator=generator))


def _header(profile: pb.KvProfile, seed: int = 0, ids=HEADER_IDS, dtype: str | None = None, layers: int = LAYERS,
            keys: torch.Tensor | None = None) -> bytes:
    key = header_key(profile.profile_id, ids)
    made_keys, values = _tensors(len(ids), seed, layers)
    return encode_kv_blob(KvBlobHeader(profile.profile_id, key.user_id, key.fact_id, key.version,
                                       dtype or profile.kv_dtype, layers, len(ids), HEADS, DIM, tuple(ids),
                                       key.content_id), made_keys if keys is None else keys, values)


def _announce(stub, profile: pb.KvProfile, header: bytes, worker: str) -> pb.AnnounceProfileResponse:
    return stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER,
                                                          announcer_id=worker, header_kv=header))


def _served_header(stub, profile: pb.KvProfile) -> bytes:
    """The header KV a node gets for the profile (b"" when none is served)."""
    retrieved = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=CHECKS_USER, query="anything", top_k=1,
                                                                 profile=profile, node_id="n1"))
    if not retrieved.header_content_id:
        return b""
    (reply,) = stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id, user_id=CHECKS_USER,
                                              include_header=True, header_content_id=retrieved.header_content_id))
    return reply.blob


def _quarantined(memory_service: MemoryServiceProcess, profile: pb.KvProfile) -> list[tuple[str, str, bytes]]:
    path = Path(memory_service.data_dir) / "kv" / "index.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as database:
        rows = database.execute("SELECT worker_id, reason, blob FROM kv_quarantine WHERE profile_id = ? "
                                "ORDER BY quarantined_at", (profile.profile_id,)).fetchall()
    database.close()
    return [(worker, reason, bytes(blob)) for worker, reason, blob in rows]


def _counter(memory_service: MemoryServiceProcess, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{memory_service.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _header_wanted(stub, profile: pb.KvProfile, worker: str) -> bool:
    return stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id=worker, profile_id=profile.profile_id)).header_kv_wanted


@pytest.fixture(scope="module", autouse=True)
def checks_user(stub) -> None:
    stub.IngestFacts(pb.IngestFactsRequest(user_id=CHECKS_USER, facts=[
        pb.FactInput(fact_id="f0", text="one two three"), pb.FactInput(fact_id="f1", text="four five six")]))


HEADER_CASES = [
    ("another header's token ids", {"ids": (5, 6, 7)}, "header_hash"),
    ("another dtype", {"dtype": "bfloat16"}, "kv_dtype is float32"),
    ("a NaN", {"keys": torch.full((LAYERS, len(HEADER_IDS), HEADS, DIM), float("nan"))}, "NaN"),
    ("an infinity", {"keys": torch.full((LAYERS, len(HEADER_IDS), HEADS, DIM), float("inf"))}, "infinity"),
]


@pytest.mark.parametrize(("case", "fields", "problem"), HEADER_CASES, ids=[case[0] for case in HEADER_CASES])
def test_a_header_that_is_not_the_profiles_is_refused_and_changes_nothing(stub, memory_service, case, fields,
                                                                         problem) -> None:
    profile = _profile("header-checks")
    first = _header(profile)
    _announce(stub, profile, first, "w-first")
    with pytest.raises(grpc.RpcError) as raised:
        _announce(stub, profile, _header(profile, seed=1, **fields), "w-second")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert raised.value.details().startswith("header_kv:") and problem in raised.value.details()
    assert _served_header(stub, profile) == first and _quarantined(memory_service, profile) == []


def _lease_and_upload(stub, profile: pb.KvProfile, worker: str, make) -> tuple[pb.LeaseKvWorkResponse, list]:
    lease = stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id=worker, profile_id=profile.profile_id, max_facts=10))
    uploads = []
    for index, item in enumerate(lease.items):
        tokens = (1, 2, 3)
        dtype, layers, keys = make(index)
        made_keys, values = _tensors(len(tokens), index, layers)
        header = KvBlobHeader(profile.profile_id, item.user_id, item.fact_id, item.version, dtype, layers,
                              len(tokens), HEADS, DIM, tokens, content_id(profile.profile_id, HEADER_IDS, tokens))
        uploads.append(pb.FactKvUpload(user_id=item.user_id, fact_id=item.fact_id, version=item.version,
                                       blob=encode_kv_blob(header, made_keys if keys is None else keys, values)))
    return lease, uploads


FACT_CASES = [
    ("another dtype", lambda index: ("bfloat16" if index else "float32", LAYERS, None), "kv_dtype is float32"),
    ("a NaN", lambda index: ("float32", LAYERS, torch.full((LAYERS, 3, HEADS, DIM), float("nan")) if index else None),
     "NaN"),
    ("another layout than the header's", lambda index: ("float32", LAYERS + index, None), "layers"),
]


@pytest.mark.parametrize(("case", "make", "problem"), FACT_CASES, ids=[case[0] for case in FACT_CASES])
def test_fact_kv_that_does_not_fit_the_profile_is_refused_and_nothing_of_the_call_is_stored(stub, case, make,
                                                                                           problem) -> None:
    profile = _profile(f"fact-checks-{case}")
    _announce(stub, profile, _header(profile), "w-header")
    lease, uploads = _lease_and_upload(stub, profile, "w-facts", make)
    assert len(uploads) == 2
    with pytest.raises(grpc.RpcError) as raised:
        stub.CompleteKvWork(pb.CompleteKvWorkRequest(lease_id=lease.lease_id, worker_id="w-facts",
                                                     profile_id=profile.profile_id, results=uploads))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert raised.value.details().startswith("results[1].blob:") and problem in raised.value.details()
    stats = next(p for p in stub.GetStats(pb.GetStatsRequest()).profiles if p.profile_id == profile.profile_id)
    assert (stats.done, stats.leased) == (0, 2)


def test_a_differing_header_is_a_loud_conflict_set_aside_and_a_third_worker_decides(stub, memory_service) -> None:
    """Regression (issue 31 review, H1): a differing header withdrew the stored, audited header and barred its honest
    producer, and a barred worker's header was compared (and withdrew the next honest header) whenever one was stored.
    Now the newer one is set aside (loud: counted, logged, quarantined), the stored one stays served, and the worker
    whose header differed is refused before any comparison."""
    profile = _profile("header-conflict")
    stored = _header(profile, seed=0)
    _announce(stub, profile, stored, "w-a")
    conflicts, mismatches, matches = (_counter(memory_service, "inferscale_kv_header_conflicts_total"),
                                      _counter(memory_service, "inferscale_kv_audits_total", '{outcome="mismatch"}'),
                                      _counter(memory_service, "inferscale_kv_audits_total", '{outcome="match"}'))
    assert _header_wanted(stub, profile, "w-b")  # the stored header waits for another worker's audit
    keys, _ = _tensors(len(HEADER_IDS), 0)
    _announce(stub, profile, _header(profile, seed=0, keys=keys * (1 + 1e-6)), "w-b")  # an honest recomputation
    assert _counter(memory_service, "inferscale_kv_audits_total", '{outcome="match"}') == matches + 1
    assert not _header_wanted(stub, profile, "w-c") and _served_header(stub, profile) == stored

    differing = _header(profile, seed=9)
    _announce(stub, profile, differing, "w-c")  # not an error to the worker: it is told nothing
    assert _counter(memory_service, "inferscale_kv_header_conflicts_total") == conflicts + 1
    assert _counter(memory_service, "inferscale_kv_audits_total", '{outcome="mismatch"}') == mismatches
    assert _served_header(stub, profile) == stored  # the stored header stays served
    assert [(worker, blob) for worker, _, blob in _quarantined(memory_service, profile)] == [("w-c", differing)]
    logged = [json.loads(line) for line in memory_service.log_path.read_text().splitlines()
              if '"kv_header_conflict"' in line]
    assert [(entry["stored_by"], entry["differing_from"]) for entry in logged
            if entry["profile_id"] == profile.profile_id] == [("w-a", "w-c")]
    assert not _header_wanted(stub, profile, "w-c")  # it differed: never asked again for this header
    for _ in range(3):  # nor heard: refused before any comparison, so it knocks nothing out
        _announce(stub, profile, differing, "w-c")
    assert _counter(memory_service, "inferscale_kv_header_conflicts_total") == conflicts + 1
    assert _served_header(stub, profile) == stored
    assert any(json.loads(line).get("worker_id") == "w-c"
               for line in memory_service.log_path.read_text().splitlines() if '"kv_header_refused"' in line)
    assert not _header_wanted(stub, profile, "w-a")  # its producer is not barred, but it does not audit itself
    assert not _header_wanted(stub, profile, "w-d")  # confirmed by two workers: nobody is asked again
    _announce(stub, profile, stored, "w-d")  # an agreeing header changes nothing
    assert _counter(memory_service, "inferscale_kv_audits_total", '{outcome="match"}') == matches + 1
    assert _served_header(stub, profile) == stored and not _header_wanted(stub, profile, "w-e")


def test_an_unconfirmed_header_a_worker_disputes_is_withdrawn_and_the_header_two_workers_agree_on_is_stored(
        stub, memory_service) -> None:
    """Regression (issue 43, the table's second row): the third of three differing headers withdrew the stored one and
    was stored, though no other worker agreed with it. Now a header disputed before a second worker confirmed it is
    served as text until two workers agree, and one they agree on is what is stored."""
    profile = _profile("header-audit-mismatch", kv_dtype="bfloat16")
    mismatches = _counter(memory_service, "inferscale_kv_audits_total", '{outcome="mismatch"}')
    first, second, third = _header(profile, seed=0), _header(profile, seed=1), _header(profile, seed=2)
    _announce(stub, profile, first, "w-a")
    assert _served_header(stub, profile) == first  # a one-witness service: served until disputed
    _announce(stub, profile, third, "w-a")  # its own producer cannot withdraw it: refused, nothing changes
    assert _served_header(stub, profile) == first and _quarantined(memory_service, profile) == []
    assert _header_wanted(stub, profile, "w-b")
    _announce(stub, profile, second, "w-b")  # one against one: neither is served
    assert _served_header(stub, profile) == b""
    assert _counter(memory_service, "inferscale_kv_audits_total", '{outcome="mismatch"}') == mismatches + 1
    assert [worker for worker, _, _ in _quarantined(memory_service, profile)] == ["w-a", "w-b"]
    assert not _header_wanted(stub, profile, "w-a") and not _header_wanted(stub, profile, "w-b")
    assert _header_wanted(stub, profile, "w-c")
    _announce(stub, profile, third, "w-c")  # a third header no one agrees with: stored nowhere, served nowhere
    assert _served_header(stub, profile) == b""
    _announce(stub, profile, second, "w-d")  # agrees with w-b: stored; w-a and w-c barred
    served = _served_header(stub, profile)  # under another name than the withdrawn one's
    assert kv_difference(served, second) == 0.0
    assert decode_kv_blob(served).header.content_id != decode_kv_blob(first).header.content_id
    assert sorted((worker, reason.split(":")[1].strip()[:8]) for worker, reason, _ in
                  _quarantined(memory_service, profile)) == [("w-a", "outvoted"), ("w-c", "outvoted")]
    for worker in ("w-a", "w-b", "w-c", "w-e"):  # confirmed by two: nobody is asked; the outvoted are barred
        assert not _header_wanted(stub, profile, worker)
    _announce(stub, profile, first, "w-a")  # barred: refused before any comparison
    _announce(stub, profile, third, "w-e")  # a differing header against a confirmed one: kept aside, nothing replaced
    assert _served_header(stub, profile) == served


def test_a_header_of_another_layout_is_a_conflict_not_a_lock_on_the_profile(stub, memory_service) -> None:
    """Regression (issue 31 review, H2): the first header's layout became the profile's, so an honest header of the
    model's layout after a bogus first one was INVALID_ARGUMENT (no conflict, no audit) and the profile stayed locked
    to the bogus layout. Now it is a differing header like any other: a conflict that withdraws the unconfirmed
    bogus one, and the header two workers agree on is stored; the profile's layout is then the honest header's, whose
    facts are accepted."""
    profile = _profile("header-layout")
    bogus, honest = _header(profile, layers=LAYERS + 1), _header(profile, seed=1)
    conflicts = _counter(memory_service, "inferscale_kv_header_conflicts_total")
    _announce(stub, profile, bogus, "w-bogus")
    _announce(stub, profile, honest, "w-a")  # no error: a conflict, and nothing is served
    assert _counter(memory_service, "inferscale_kv_header_conflicts_total") == conflicts + 1
    assert _served_header(stub, profile) == b""
    _announce(stub, profile, honest, "w-b")  # a second worker agrees: the honest one stored
    assert _counter(memory_service, "inferscale_kv_header_conflicts_total") == conflicts + 1
    assert kv_difference(_served_header(stub, profile), honest) == 0.0
    lease, uploads = _lease_and_upload(stub, profile, "w-a", lambda index: ("float32", LAYERS, None))
    assert stub.CompleteKvWork(pb.CompleteKvWorkRequest(lease_id=lease.lease_id, worker_id="w-a",
                                                        profile_id=profile.profile_id,
                                                        results=uploads)).accepted == len(uploads) == 2
