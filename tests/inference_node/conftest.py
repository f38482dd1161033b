"""Fixtures for inference node tests: memory service + precomputed tiny-model KV + a real vLLM node."""

from __future__ import annotations

import itertools
import json
import secrets
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from harness.inference_node import InferenceNodeProcess
from inference_node.plan import PLAN_SECRET_ENV
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.blob import KvBlobHeader, encode_kv_blob
from inferscale_kv.kv_key import content_id
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
from inferscale_kv.stored_text import StoredTextGuard
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
