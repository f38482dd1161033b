"""The worker's lease loop when the service refuses its header."""

from __future__ import annotations

from pathlib import Path

import grpc
from transformers import AutoTokenizer

from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.layout import memory_header_ids
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
from precompute_worker.encoder import FactEncoder
from precompute_worker.worker import PrecomputeWorker


class _Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self) -> str:
        return "header_kv: refused"


class _RefusingStub:
    """A service that asks for the header, refuses it, and records what is completed."""

    def __init__(self) -> None:
        self.completed: list[pb.CompleteKvWorkRequest] = []
        self.announced = 0

    def LeaseKvWork(self, request: pb.LeaseKvWorkRequest) -> pb.LeaseKvWorkResponse:
        return pb.LeaseKvWorkResponse(lease_id="lease-1", header_kv_wanted=True, items=[
            pb.KvWorkItem(user_id="u", fact_id="f", version=1, text="Ana keeps bees.")])

    def AnnounceProfile(self, request: pb.AnnounceProfileRequest) -> pb.AnnounceProfileResponse:
        self.announced += 1
        raise _Refused()

    def CompleteKvWork(self, request: pb.CompleteKvWorkRequest, timeout: float) -> pb.CompleteKvWorkResponse:
        self.completed.append(request)
        return pb.CompleteKvWorkResponse(accepted=len(request.results))


def test_a_refused_header_announce_does_not_drop_the_lease(tiny_llama_dir: Path) -> None:
    """Regression (issue 31 review, H2): an AnnounceProfile error (a header of another layout than a bogus stored
    one was INVALID_ARGUMENT) escaped run_once, so the worker never completed the facts it had leased."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    stub = _RefusingStub()
    worker = PrecomputeWorker(stub, FactEncoder.from_pretrained(tiny_llama_dir), tokenizer,
                              memory_header_ids(tokenizer),
                              build_model_profile(tiny_llama_dir, tokenizer, "float32", DEFAULT_CONTEXT_WINDOW), "w")
    assert worker.run_once() == 1
    assert stub.announced == 1
    assert [(r.lease_id, [u.fact_id for u in r.results]) for r in stub.completed] == [("lease-1", ["f"])]
