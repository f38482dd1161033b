"""The precompute loop: lease facts, encode them (shared-conversation CWE), upload their KV, repeat."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog

from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.blob import KvBlobHeader, encode_kv_blob
from inferscale_kv.device_telemetry import read_device
from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, HEADER_VERSION, content_id
from inferscale_kv.model_profile import ModelProfile
from precompute_worker.encoder import EncodedFact, EncodingGroup, FactEncoder, FactKey, FactSpec
from precompute_worker.grouping import ConversationTurn, FactJob, GroupBuilder

log = structlog.get_logger(__name__)

UPLOAD_CHUNK_BYTES = 16 << 20
HEADER_KEY = FactKey(HEADER_OWNER, HEADER_FACT_ID, HEADER_VERSION)


@dataclass
class WorkerStats:
    facts_done: int = 0
    facts_failed: int = 0
    encode_seconds: float = 0.0
    batches: int = 0

    @property
    def facts_per_second(self) -> float:
        return self.facts_done / self.encode_seconds if self.encode_seconds else 0.0


def profile_message(profile: ModelProfile) -> pb.KvProfile:
    return pb.KvProfile(**profile.as_dict())


class PrecomputeWorker:
    def __init__(self, stub: memory_pb2_grpc.MemoryServiceStub, encoder: FactEncoder, tokenizer,
                 header_ids: Sequence[int], profile: ModelProfile, worker_id: str, *, max_facts: int = 64,
                 lease_seconds: int = 120, shared_encoding: bool = True) -> None:
        self.stub = stub
        self.encoder = encoder
        self.profile = profile
        self.worker_id = worker_id
        self.max_facts = max_facts
        self.lease_seconds = lease_seconds
        self.shared_encoding = shared_encoding
        self.groups = GroupBuilder(tokenizer, header_ids, profile.context_window, profile.max_context_tokens,
                                   max_group_tokens=encoder.max_tokens_per_forward)
        self.stats = WorkerStats()

    def header_blob(self) -> bytes:
        """The memory header's KV (a plain prefix: exact), stored beside the facts for the nodes."""
        (encoded,) = self.encoder.encode([EncodingGroup([], [FactSpec(HEADER_KEY, list(self.groups.header_ids), 0)])])
        return self._upload(encoded).blob

    def announce(self) -> int:
        response = self.stub.AnnounceProfile(pb.AnnounceProfileRequest(
            profile=profile_message(self.profile), role=pb.PROFILE_ROLE_WORKER, announcer_id=self.worker_id,
            header_kv=self.header_blob()))
        log.info("profile_announced", profile_id=response.profile_id, facts_queued=response.facts_queued)
        return response.facts_queued

    def run_once(self) -> int:
        """Leases, encodes and uploads one batch; returns the number of facts leased (0 when idle)."""
        reading = read_device()  # None without NVML (no GPU)
        lease = self.stub.LeaseKvWork(pb.LeaseKvWorkRequest(
            worker_id=self.worker_id, profile_id=self.profile.profile_id, max_facts=self.max_facts,
            lease_seconds=self.lease_seconds, facts_per_second=self.stats.facts_per_second,
            device=pb.WorkerDevice(**dataclasses.asdict(reading)) if reading else None))
        if lease.header_kv_wanted:  # none is served and this worker proposed none, or one waits for a 2nd worker
            try:
                self.announce()
            except grpc.RpcError as exc:  # the lease is worked on all the same (it expires otherwise)
                log.warning("header_announce_failed", code=exc.code().name, details=exc.details())
        if not lease.items:
            return 0
        jobs = [FactJob(FactKey(i.user_id, i.fact_id, i.version), i.text, i.source_turn_id) for i in lease.items]
        turns = {u.user_id: [ConversationTurn(t.turn_id, t.speaker, t.text) for t in u.turns] for u in lease.turns}
        started = time.perf_counter()
        try:
            groups = self.groups.shared(jobs, turns) if self.shared_encoding else self.groups.naive(jobs, turns)
            encoded = self.encoder.encode(groups)
        except Exception as exc:  # report the batch as failed; the service re-queues it
            log.exception("encode_failed", facts=len(jobs))
            self._complete(lease.lease_id, [], [(job.key, repr(exc)) for job in jobs])
            self.stats.facts_failed += len(jobs)
            return len(jobs)
        elapsed = time.perf_counter() - started
        self.stats.encode_seconds += elapsed
        self.stats.facts_done += len(encoded)
        self.stats.batches += 1
        self._complete(lease.lease_id, [self._upload(fact) for fact in encoded], [])
        log.info("batch_done", facts=len(encoded), groups=len(groups), encode_s=round(elapsed, 3),
                 facts_per_s=round(len(encoded) / elapsed, 1) if elapsed else None)
        return len(jobs)

    def _upload(self, fact: EncodedFact) -> pb.FactKvUpload:
        key = fact.spec.key
        header = KvBlobHeader(
            profile_id=self.profile.profile_id, user_id=key.user_id, fact_id=key.fact_id, version=key.version,
            storage_dtype=self.profile.kv_dtype, num_layers=fact.keys.shape[0], num_tokens=fact.keys.shape[1],
            num_kv_heads=fact.keys.shape[2], head_dim=fact.keys.shape[3], token_ids=tuple(fact.spec.token_ids),
            content_id=content_id(self.profile.profile_id, fact.context_ids, fact.spec.token_ids))
        blob = encode_kv_blob(header, fact.keys, fact.values)
        return pb.FactKvUpload(user_id=key.user_id, fact_id=key.fact_id, version=key.version, blob=blob)

    def _complete(self, lease_id: str, uploads: list[pb.FactKvUpload], failures: list[tuple[FactKey, str]]) -> None:
        chunk: list[pb.FactKvUpload] = []
        size = 0
        chunks: list[list[pb.FactKvUpload]] = []
        for upload in uploads:
            if chunk and size + len(upload.blob) > UPLOAD_CHUNK_BYTES:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(upload)
            size += len(upload.blob)
        chunks.append(chunk)
        failure_messages = [pb.FactKvFailure(user_id=k.user_id, fact_id=k.fact_id, version=k.version, error=e)
                            for k, e in failures]
        for index, part in enumerate(chunks):
            self.stub.CompleteKvWork(pb.CompleteKvWorkRequest(
                lease_id=lease_id, worker_id=self.worker_id, profile_id=self.profile.profile_id, results=part,
                failures=failure_messages if index == 0 else []), timeout=300)

    def run(self, *, exit_when_idle: bool = False, poll_interval_s: float = 1.0, stop=None) -> WorkerStats:
        """Works until `stop()` is true (or, with exit_when_idle, until a lease comes back empty)."""
        while stop is None or not stop():
            try:
                leased = self.run_once()
            except grpc.RpcError as exc:
                log.warning("memory_service_unreachable", code=exc.code().name, details=exc.details())
                time.sleep(poll_interval_s)
                continue
            if not leased:
                if exit_when_idle:
                    break
                time.sleep(poll_interval_s)
        return self.stats
