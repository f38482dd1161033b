"""The KV audit through a real memory service (--kv-audit-share 1: every new fact KV is audited) with real workers
(`python -m precompute_worker` on the tiny Llama) and a stand-in worker that uploads wrong tensors under the right
names (the facts' own token ids and content ids, so that only the values give it away).

The auditor does not know it audits (its lease items are ordinary ones); its KV of honest facts matches the stored
KV within the tolerance, its KV of the stand-in's facts does not: those entries are withdrawn (RetrieveAndStage
reports them not ready, so nodes serve the facts as text), counted, logged with the worker that produced them, kept
aside, and computed again by a third worker (neither the producer nor the auditor), whose KV is served."""

from __future__ import annotations

import json
import re
import sqlite3
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.blob import KvBlobHeader, decode_kv_blob, encode_kv_blob
from inferscale_kv.kv_key import content_id
from inferscale_kv.layout import fact_token_ids, memory_header_ids, token_hash
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW, kv_profile_id
from memory_service.coordination import audits as audits_module
from memory_service.coordination.audits import KvAudits
from memory_service.coordination.schema import create_schema
from memory_service.kv_checks import AUDIT_TOLERANCES, kv_difference
from memory_service.sql import SqliteDatabase
from precompute_worker.encoder import FactKey
from precompute_worker.grouping import ConversationTurn, FactJob, GroupBuilder
from precompute_worker.worker import profile_message
from tests.conftest import own_memory_service, run_worker

HONEST = {"h0": "Hana grows basil on her balcony.", "h1": "Hana swims in the lake every morning.",
          "h2": "Hana's brother lives in Porto."}
VICTIM = {"v0": "Vera keeps bees behind the old barn.", "v1": "Vera's daughter studies music in Vienna.",
          "v2": "Vera is allergic to walnuts."}


@pytest.fixture(scope="module")
def memory_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemoryServiceProcess]:
    """A service of this module's own, auditing every new fact KV: its workers' identities and bars are its own."""
    with own_memory_service(tmp_path_factory, "kv_audit", "--kv-audit-share", "1") as service:
        yield service


def wrong_kv_worker(stub, profile: pb.KvProfile, tokenizer, user_id: str, worker_id: str) -> int:
    """Plays a worker that uploads random tensors of the model's shape for `user_id`'s leased facts, under their true
    names (token ids, and the content id of the header they are encoded behind); other items are reported failed.
    Returns the facts accepted."""
    header = memory_header_ids(tokenizer)
    lease = stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id=worker_id, profile_id=profile.profile_id, max_facts=64))
    uploads, failures = [], []
    generator = torch.Generator().manual_seed(7)
    for item in lease.items:
        if item.user_id != user_id:
            failures.append(pb.FactKvFailure(user_id=item.user_id, fact_id=item.fact_id, version=item.version,
                                             error="not mine"))
            continue
        tokens = fact_token_ids(tokenizer, item.text)
        keys, values = (torch.randn((4, len(tokens), 2, 64), generator=generator) for _ in range(2))
        blob_header = KvBlobHeader(profile.profile_id, item.user_id, item.fact_id, item.version, "float32", 4,
                                   len(tokens), 2, 64, tuple(tokens), content_id(profile.profile_id, header, tokens))
        uploads.append(pb.FactKvUpload(user_id=item.user_id, fact_id=item.fact_id, version=item.version,
                                       blob=encode_kv_blob(blob_header, keys, values)))
    assert uploads, f"no leased facts of {user_id}"
    return stub.CompleteKvWork(pb.CompleteKvWorkRequest(lease_id=lease.lease_id, worker_id=worker_id,
                                                        profile_id=profile.profile_id, results=uploads,
                                                        failures=failures)).accepted


def _retrieved(stub, profile: pb.KvProfile, user_id: str) -> dict[str, pb.RetrievedFact]:
    response = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=user_id, query="where and what", top_k=10,
                                                                profile=profile, node_id="n1"))
    return {fact.fact_id: fact for fact in response.facts}


def _fetched(stub, profile: pb.KvProfile, user_id: str, facts: dict[str, pb.RetrievedFact]) -> dict[str, bytes]:
    refs = [pb.FactRef(fact_id=f.fact_id, version=f.version, content_id=f.content_id) for f in facts.values()]
    replies = stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id, user_id=user_id, facts=refs))
    return {reply.fact_id: reply.blob for reply in replies}


def _audits(memory_service: MemoryServiceProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{memory_service.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {outcome: float(count) for outcome, count in
            re.findall(r'^inferscale_kv_audits_total\{outcome="(\w+)"\} (\S+)$', text, re.MULTILINE) if float(count)}


def _quarantined_workers(memory_service: MemoryServiceProcess, user_id: str) -> list[tuple[str, str]]:
    path = Path(memory_service.data_dir) / "kv" / "index.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as database:
        rows = database.execute("SELECT fact_id, worker_id FROM kv_quarantine WHERE user_id = ? ORDER BY fact_id, "
                                "worker_id", (user_id,)).fetchall()
    database.close()
    return rows


def test_the_audit_withdraws_wrong_kv_and_a_third_worker_recomputes_it(memory_service, stub, tiny_llama_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    profile = profile_message(build_model_profile(tiny_llama_dir, tokenizer, "float32", DEFAULT_CONTEXT_WINDOW))
    stub.IngestFacts(pb.IngestFactsRequest(user_id="honest", facts=[
        pb.FactInput(fact_id=fact_id, text=text) for fact_id, text in HONEST.items()]))
    run_worker(memory_service, tiny_llama_dir, "--worker-id", "worker-1")  # the header and the honest user's facts
    stub.IngestFacts(pb.IngestFactsRequest(user_id="victim", facts=[
        pb.FactInput(fact_id=fact_id, text=text) for fact_id, text in VICTIM.items()]))
    assert wrong_kv_worker(stub, profile, tokenizer, "victim", "liar") == len(VICTIM)
    planted = _retrieved(stub, profile, "victim")
    assert all(fact.kv_ready for fact in planted.values())  # until its audit, an entry is served as today
    assert _audits(memory_service) == {}  # no result yet

    run_worker(memory_service, tiny_llama_dir, "--worker-id", "worker-2")  # audits all of it, unknowingly
    audits = _audits(memory_service)
    assert audits.get("mismatch") == len(VICTIM)
    assert audits.get("match") == len(HONEST) + 1  # the honest facts and the header
    assert not any(fact.kv_ready for fact in _retrieved(stub, profile, "victim").values())
    assert all(fact.kv_ready for fact in _retrieved(stub, profile, "honest").values())
    logged = [json.loads(line) for line in memory_service.log_path.read_text().splitlines()
              if '"kv_audit_mismatch"' in line]
    assert sorted((entry["fact_id"], entry["producer"], entry["auditor"]) for entry in logged) == [
        (fact_id, "liar", "worker-2") for fact_id in sorted(VICTIM)]
    assert all(entry["difference"] > AUDIT_TOLERANCES["float32"] for entry in logged)
    assert _quarantined_workers(memory_service, "victim") == [(fact_id, worker) for fact_id in sorted(VICTIM)
                                                       for worker in ("liar", "worker-2")]
    victim_stats = next(p for p in stub.GetStats(pb.GetStatsRequest(user_id="victim")).profiles)
    assert (victim_stats.done, victim_stats.queued) == (0, len(VICTIM))
    for barred in ("liar", "worker-2"):  # neither the producer nor the auditor computes the facts again
        lease = stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id=barred, profile_id=profile.profile_id))
        assert not [item for item in lease.items if item.user_id == "victim"]

    run_worker(memory_service, tiny_llama_dir, "--worker-id", "worker-3")
    recomputed = _retrieved(stub, profile, "victim")
    assert all(fact.kv_ready for fact in recomputed.values())
    # Served under other names than the withdrawn KV: a node that cached the planted bytes cannot take them for these.
    assert not {fact.content_id for fact in recomputed.values()} & {fact.content_id for fact in planted.values()}
    assert not any(_fetched(stub, profile, "victim", planted).values())
    blobs = _fetched(stub, profile, "victim", recomputed)
    auditors = {fact_id: blob for fact_id, worker, blob in _quarantined_blobs(memory_service, "victim")
                if worker == "worker-2"}
    for fact_id, blob in blobs.items():
        assert kv_difference(auditors[fact_id], blob) <= AUDIT_TOLERANCES["float32"]
        assert decode_kv_blob(blob).header.content_id == recomputed[fact_id].content_id
    run_worker(memory_service, tiny_llama_dir, "--worker-id", "worker-1")  # audits worker-3's KV: it passes
    assert _audits(memory_service).get("match") == audits["match"] + len(VICTIM)
    assert all(fact.kv_ready for fact in _retrieved(stub, profile, "victim").values())


def _quarantined_blobs(memory_service: MemoryServiceProcess, user_id: str) -> list[tuple[str, str, bytes]]:
    path = Path(memory_service.data_dir) / "kv" / "index.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as database:
        rows = database.execute("SELECT fact_id, worker_id, blob FROM kv_quarantine WHERE user_id = ?",
                                (user_id,)).fetchall()
    database.close()
    return [(fact_id, worker, bytes(blob)) for fact_id, worker, blob in rows]


def test_deleting_a_user_drops_its_quarantined_kv(memory_service, stub) -> None:
    assert _quarantined_workers(memory_service, "victim")
    stub.DeleteUser(pb.DeleteUserRequest(user_id="victim"))
    assert _quarantined_workers(memory_service, "victim") == []


def test_an_audit_of_kv_whose_turns_changed_is_stale_and_the_fact_computed_again(memory_service, stub,
                                                                                tiny_llama_dir) -> None:
    """Regression (issue 31 review, H3): IngestTurns rewrites a turn by its id and leaves the facts' KV; the auditor
    then encodes another window, so its content id differs from the entry's and the audit counted as a mismatch:
    both honest workers barred, everything they stored audited again. Now it is stale: the entry is computed again
    from the current turns, nobody is barred, nothing kept aside, no audits added."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    profile = profile_message(build_model_profile(tiny_llama_dir, tokenizer, "float32", DEFAULT_CONTEXT_WINDOW))
    stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER,
                                                   announcer_id="edit-producer"))
    user = "edited"
    stub.IngestTurns(pb.IngestTurnsRequest(user_id=user, turns=[
        pb.Turn(turn_id=f"t{i}", seq=i, speaker="Ana", text=f"turn number {i}") for i in range(3)]))
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[
        pb.FactInput(fact_id="f", text="Ana keeps bees.", source_turn_id="t2")]))
    builder = GroupBuilder(tokenizer, memory_header_ids(tokenizer), DEFAULT_CONTEXT_WINDOW, 0, 4096)

    def compute(worker: str) -> pb.LeaseKvWorkResponse:
        """Leases as `worker` and uploads the same tensors for the user's fact, named after the window it was
        leased with."""
        lease = stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id=worker, profile_id=profile.profile_id))
        jobs = [FactJob(FactKey(i.user_id, i.fact_id, i.version), i.text, i.source_turn_id) for i in lease.items
                if i.user_id == user]
        turns = {u.user_id: [ConversationTurn(t.turn_id, t.speaker, t.text) for t in u.turns] for u in lease.turns}
        (group,) = builder.naive(jobs, turns)
        spec = group.facts[0]
        keys = torch.ones((4, len(spec.token_ids), 2, 64))
        header = KvBlobHeader(profile.profile_id, user, "f", jobs[0].key.version, "float32", 4, len(spec.token_ids),
                              2, 64, tuple(spec.token_ids),
                              content_id(profile.profile_id, group.context_ids[:spec.prefix_length], spec.token_ids))
        upload = pb.FactKvUpload(user_id=user, fact_id="f", version=jobs[0].key.version,
                                 blob=encode_kv_blob(header, keys, torch.ones_like(keys)))
        stub.CompleteKvWork(pb.CompleteKvWorkRequest(lease_id=lease.lease_id, worker_id=worker,
                                                     profile_id=profile.profile_id, results=[upload]))
        return lease

    compute("edit-producer")
    stub.IngestTurns(pb.IngestTurnsRequest(user_id=user, turns=[pb.Turn(turn_id="t0", seq=0, speaker="Ana",
                                                                        text="edited")]))
    before = _audits(memory_service)
    waiting = _gauge(memory_service, "inferscale_kv_audits_waiting")
    compute("edit-auditor")  # the audit of the producer's entry, from the edited window
    after = _audits(memory_service)
    assert after.get("mismatch", 0) == before.get("mismatch", 0)
    assert after.get("stale", 0) == before.get("stale", 0) + 1
    assert _quarantined_workers(memory_service, user) == [] and _barred(memory_service, user) == []
    assert _gauge(memory_service, "inferscale_kv_audits_waiting") == waiting - 1  # its own audit done, none added
    assert not _retrieved(stub, profile, user)["f"].kv_ready  # served as text until computed again
    lease = compute("edit-producer")  # not barred: it computes the fact again, from the current turns
    assert [item.fact_id for item in lease.items if item.user_id == user] == ["f"]
    assert _retrieved(stub, profile, user)["f"].kv_ready


def _gauge(memory_service: MemoryServiceProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{memory_service.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _barred(memory_service: MemoryServiceProcess, user_id: str) -> list[tuple[str, str]]:
    path = Path(memory_service.data_dir) / "kv" / "index.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as database:
        rows = database.execute("SELECT fact_id, worker_id FROM kv_exclusions WHERE user_id = ?", (user_id,)).fetchall()
    database.close()
    return rows


def test_a_mismatch_adds_a_bounded_number_of_audits(tmp_path: Path, monkeypatch) -> None:
    """Regression (issue 31 review, H3): a mismatch had every entry either worker stored audited, however many."""
    database = SqliteDatabase(tmp_path / "index.sqlite")
    create_schema(database)
    with database.transaction() as tx:
        for index in range(5):
            tx.run("INSERT INTO kv_entries (profile_id, user_id, fact_id, version, content_id, token_ids, nbytes, "
                   "stored_at, producer) VALUES ('p', 'u', ?, 1, 'c', '[]', 1, ?, 'w')", (f"f{index}", index))
    monkeypatch.setattr(audits_module, "ESCALATED_AUDITS_MAX", 3)
    audits = KvAudits(database, max_attempts=3)
    assert audits.escalate("p", ["w"]) == 3
    assert sorted(fact for (fact,) in database.query("SELECT fact_id FROM kv_audits")) == ["f2", "f3", "f4"]


def _synthetic_upload(profile: pb.KvProfile, item: pb.KvWorkItem) -> pb.FactKvUpload:
    tokens = tuple(range(len(item.text.split())))
    header = KvBlobHeader(profile.profile_id, item.user_id, item.fact_id, item.version, "float32", 2, len(tokens), 1,
                          4, tokens, content_id(profile.profile_id, [], tokens))
    keys = torch.ones((2, len(tokens), 1, 4))
    return pb.FactKvUpload(user_id=item.user_id, fact_id=item.fact_id, version=item.version,
                           blob=encode_kv_blob(header, keys, keys))


def test_an_audit_no_auditor_finishes_is_given_up_and_its_fact_computed_again(memory_service, stub) -> None:
    """Regression (issue 31 review, M1): an audit leased --kv-max-attempts times (3) without a result was dropped and
    its entry left served, unaudited (an auditor holding it, or never answering, kept wrong KV served). Now the entry
    is withdrawn (served as text) and its fact queued again, nobody barred."""
    profile = pb.KvProfile(model="model-abandoned-audit", model_hash="mh", kv_dtype="float32", tokenizer_hash="th",
                           header_hash=token_hash((1, 2, 3)), recipe="chunked-rope-cwe", recipe_version=1,
                           context_window=2)
    profile.profile_id = kv_profile_id(profile)
    stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER,
                                                   announcer_id="producer"))
    user = "unaudited"
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[pb.FactInput(fact_id="a0", text="Uma sails.")]))

    def lease(worker: str, lease_seconds: int = 60) -> pb.LeaseKvWorkResponse:
        return stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id=worker, profile_id=profile.profile_id,
                                                      max_facts=64, lease_seconds=lease_seconds))

    while (produced := lease("producer")).items:  # every fact the announcement queued, this user's among them
        stub.CompleteKvWork(pb.CompleteKvWorkRequest(
            lease_id=produced.lease_id, worker_id="producer", profile_id=profile.profile_id,
            results=[_synthetic_upload(profile, item) for item in produced.items]))
    assert _retrieved(stub, profile, user)["a0"].kv_ready
    before = _audits(memory_service).get("abandoned", 0)
    for _ in range(3):  # the memory_service's --kv-max-attempts
        audit = lease("silent-auditor", lease_seconds=1)
        assert [item.fact_id for item in audit.items if item.user_id == user] == ["a0"]
        time.sleep(1.2)
    third = lease("third")
    assert [item.fact_id for item in third.items if item.user_id == user] == ["a0"]  # computed again
    assert _audits(memory_service).get("abandoned", 0) > before
    assert not _retrieved(stub, profile, user)["a0"].kv_ready  # served as text until then
    assert _barred(memory_service, user) == [] and _quarantined_workers(memory_service, user) == []
    stub.CompleteKvWork(pb.CompleteKvWorkRequest(lease_id=third.lease_id, worker_id="third",
                                                 profile_id=profile.profile_id,
                                                 results=[_synthetic_upload(profile, item) for item in third.items]))
    assert _retrieved(stub, profile, user)["a0"].kv_ready
