"""Access control: bearer tokens from a credentials file, roles per RPC, tenants' user namespaces; unit checks of
the policy, then a real memory service started with --auth-file."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import WORKER_TOKEN_ENV
from inferscale_kv.profile import kv_profile_id
from memory_service.access import AccessControl, token_digest
from memory_service.config import ConfigError
from memory_service.errors import PermissionDenied, Unauthenticated
from tests.conftest import own_memory_service, run_worker, run_worker_process

TOKENS = {"acme-app": "acme-secret", "globex-app": "globex-secret", "nodes": "node-secret",
          "workers": "worker-secret", "ops": "admin-secret", "small-app": "small-secret", "kv-app": "kv-secret",
          "acme-nodes": "acme-node-secret"}
CREDENTIALS: list[dict[str, Any]] = [
    {"name": "acme-app", "role": "app", "user_prefix": "acme/", "token_sha256": token_digest(TOKENS["acme-app"])},
    {"name": "globex-app", "role": "app", "user_prefix": "globex/",
     "token_sha256": token_digest(TOKENS["globex-app"])},
    {"name": "nodes", "role": "node", "user_prefix": "", "token_sha256": token_digest(TOKENS["nodes"])},
    {"name": "workers", "role": "worker", "token_sha256": token_digest(TOKENS["workers"])},
    {"name": "ops", "role": "admin", "token_sha256": token_digest(TOKENS["ops"])},
    {"name": "small-app", "role": "app", "user_prefix": "small/", "max_facts": 3,
     "token_sha256": token_digest(TOKENS["small-app"])},
    {"name": "kv-app", "role": "app", "user_prefix": "kvq/", "max_kv_bytes": 1,
     "token_sha256": token_digest(TOKENS["kv-app"])},
    {"name": "acme-nodes", "role": "node", "user_prefix": "acme/", "token_sha256": token_digest(TOKENS["acme-nodes"])},
]


def _bearer(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[name]}"),)


def _access() -> AccessControl:
    return AccessControl.from_file(_write(Path(tempfile.mkdtemp()), CREDENTIALS))


def _write(directory: Path, credentials: list[dict]) -> Path:
    path = directory / "credentials.json"
    path.write_text(json.dumps({"credentials": credentials}))
    return path


def test_authenticate_returns_the_credential_whose_token_was_presented():
    access = _access()
    assert access.authenticate(_bearer("globex-app")).name == "globex-app"
    assert access.authenticate((("authorization", f"bearer {TOKENS['acme-app']}"),)).name == "acme-app"
    assert access.authenticate(_bearer("ops")).role == "admin"


@pytest.mark.parametrize("value", [None, "acme-secret", "Bearer wrong", "Bearer ", "Bearer acme-secret ",
                                   "Bearer acme-secret, Bearer globex-secret", "Bearer acme-secret globex-secret",
                                   "Bearer\tacme-secret", "Basic acme-secret"])
def test_authenticate_rejects_missing_malformed_and_unknown_tokens(value):
    with pytest.raises(Unauthenticated):
        _access().authenticate(() if value is None else (("authorization", value),))


def test_the_digest_tool_takes_only_tokens_a_bearer_header_can_carry():
    import subprocess
    import sys

    def digest(token: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "memory_service.access"], input=token + "\n", text=True,
                              capture_output=True, timeout=60)

    assert digest("acme-secret").stdout.strip() == token_digest("acme-secret")
    refused = digest("two words")
    assert refused.returncode != 0 and "RFC 6750" in refused.stderr


def test_without_credentials_every_caller_is_admitted_as_admin():
    principal = AccessControl().authenticate(())
    principal.authorize("FetchKv", pb.FetchKvRequest(user_id="anyone"))
    assert principal.role == "admin"


def test_an_app_may_touch_only_users_under_its_prefix():
    acme = _access().authenticate(_bearer("acme-app"))
    acme.authorize("IngestFacts", pb.IngestFactsRequest(user_id="acme/maya"))
    with pytest.raises(PermissionDenied, match="outside credential 'acme-app'"):
        acme.authorize("SearchFacts", pb.SearchFactsRequest(user_id="globex/maya"))
    with pytest.raises(PermissionDenied, match="must name one of its users"):
        acme.authorize("GetStats", pb.GetStatsRequest())


def test_a_worker_id_is_bound_to_the_workers_credential():
    """Regression (issue 31 review, C1): the worker ids a request claimed were taken as they came, so one worker
    credential could produce KV as one name and audit it as another. Now a claim must be the credential's name or
    `name/<process>`, and the identity audits compare is the credential's name."""
    workers = _access().authenticate(_bearer("workers"))
    assert workers.worker_identity("workers", "worker_id") == "workers"
    assert workers.worker_identity("workers/gpu-1", "worker_id") == "workers"
    for claimed in ("evil-2", "workers2", "workers-b/gpu-1", "other/workers"):
        with pytest.raises(PermissionDenied, match="announcer_id"):
            workers.worker_identity(claimed, "announcer_id")
    assert AccessControl().authenticate(()).worker_identity("anything", "worker_id") == "anything"


@pytest.mark.parametrize(("name", "method", "request_message"), [
    ("acme-app", "FetchKv", pb.FetchKvRequest(user_id="acme/maya")),
    ("acme-app", "RetrieveAndStage", pb.RetrieveAndStageRequest(user_id="acme/maya")),
    ("acme-app", "LeaseKvWork", pb.LeaseKvWorkRequest()),
    ("nodes", "IngestFacts", pb.IngestFactsRequest(user_id="acme/maya")),
    ("nodes", "DeleteUser", pb.DeleteUserRequest(user_id="acme/maya")),
    ("workers", "SearchFacts", pb.SearchFactsRequest(user_id="acme/maya")),
])
def test_a_role_may_call_only_its_own_rpcs(name, method, request_message):
    with pytest.raises(PermissionDenied, match=f"may not call {method}"):
        _access().authenticate(_bearer(name)).authorize(method, request_message)


@pytest.mark.parametrize(("credentials", "problem"), [
    ([], "no credentials"),
    ([{**CREDENTIALS[0], "token_sha256": "acme-secret"}], "token_sha256"),
    ([{**CREDENTIALS[3], "user_prefix": "acme/"}], "user_prefix"),
    ([{**CREDENTIALS[0], "role": "root"}], "role"),
    ([CREDENTIALS[0], {**CREDENTIALS[1], "name": "acme-app"}], "unique"),
    ([CREDENTIALS[0], {**CREDENTIALS[1], "token_sha256": CREDENTIALS[0]["token_sha256"]}], "share a token"),
    ([{**CREDENTIALS[4], "max_facts": 10}], "max_facts"),
    ([{**CREDENTIALS[0], "max_kv_bytes": "lots"}], "max_kv_bytes"),
    ([{**CREDENTIALS[0], "user_prefix": "acme'/"}], "user_prefix"),
    ([{**CREDENTIALS[0], "user_prefix": "acme"}], "must end with one of"),  # would also admit acme2/...
])
def test_a_bad_credentials_file_is_refused_with_the_reason(tmp_path, credentials, problem):
    with pytest.raises(ConfigError, match=problem):
        AccessControl.from_file(_write(tmp_path, credentials))


# ---------------------------------------------------------------------------------------------- a real service

@pytest.fixture(scope="module")
def guarded_service(tmp_path_factory) -> Iterator[MemoryServiceProcess]:
    credentials = _write(tmp_path_factory.mktemp("credentials"), CREDENTIALS)
    with own_memory_service(tmp_path_factory, "guarded", "--auth-file", str(credentials)) as service:
        yield service


@pytest.fixture(scope="module")
def guarded_stub(guarded_service) -> Iterator[memory_pb2_grpc.MemoryServiceStub]:
    with guarded_service.channel() as channel:
        yield memory_pb2_grpc.MemoryServiceStub(channel)


def _metadata(name: str) -> tuple[tuple[str, str], ...]:
    return _bearer(name)


def _facts_of(stub, user_id: str) -> list[str]:
    response = stub.ListFacts(pb.ListFactsRequest(user_id=user_id), metadata=_metadata("ops"))
    return [fact.text for fact in response.facts]


def test_service_rejects_a_call_without_a_token_as_unauthenticated(guarded_stub):
    with pytest.raises(grpc.RpcError) as error:
        guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="acme/maya", facts=[pb.FactInput(text="x")]))
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in error.value.details()


def test_two_credentials_on_one_call_are_unauthenticated_on_every_rpc(guarded_service, guarded_stub):
    """Regression (issue 43, the table's third row): with two `authorization` entries the last one won, so an app's
    token followed by a worker's leased KV work, and one tenant's followed by another's listed the other's facts."""
    guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="globex/eve", facts=[pb.FactInput(text="Eve's secret.")]),
                             metadata=_metadata("globex-app"))
    app_then_worker = _metadata("acme-app") + _metadata("workers")
    tenant_then_tenant = _metadata("acme-app") + _metadata("globex-app")
    one_value_two_tokens = (("authorization", f"Bearer {TOKENS['acme-app']}, Bearer {TOKENS['globex-app']}"),)
    for metadata in (app_then_worker, tenant_then_tenant, one_value_two_tokens):
        with guarded_service.channel() as channel:
            for method in pb.DESCRIPTOR.services_by_name["MemoryService"].methods:
                path = f"/{method.containing_service.full_name}/{method.name}"
                call = channel.unary_stream(path) if method.server_streaming else channel.unary_unary(path)
                with pytest.raises(grpc.RpcError) as error:
                    answer = call(b"", metadata=metadata, timeout=30)
                    if method.server_streaming:
                        list(answer)
                code = error.value.code()
                assert code == grpc.StatusCode.UNAUTHENTICATED, f"{method.name}: {code}: {error.value.details()}"
    with pytest.raises(grpc.RpcError) as error:
        guarded_stub.ListFacts(pb.ListFactsRequest(user_id="globex/eve"), metadata=tenant_then_tenant)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "exactly one credential" in error.value.details()
    assert _facts_of(guarded_stub, "globex/eve") == ["Eve's secret."]


def test_service_refuses_another_tenants_user_and_stores_nothing(guarded_stub):
    with pytest.raises(grpc.RpcError) as error:
        guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="globex/ana", facts=[pb.FactInput(text="Ana's secret")]),
                                 metadata=_metadata("acme-app"))
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _facts_of(guarded_stub, "globex/ana") == []


def test_service_lets_each_app_read_only_its_own_users(guarded_stub):
    guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="acme/maya", facts=[pb.FactInput(text="Maya has a cat.")]),
                             metadata=_metadata("acme-app"))
    found = guarded_stub.SearchFacts(pb.SearchFactsRequest(user_id="acme/maya", query="pet", top_k=5),
                                     metadata=_metadata("acme-app"))
    assert [hit.fact.text for hit in found.facts] == ["Maya has a cat."]
    with pytest.raises(grpc.RpcError) as error:
        guarded_stub.SearchFacts(pb.SearchFactsRequest(user_id="acme/maya", query="pet", top_k=5),
                                 metadata=_metadata("globex-app"))
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_each_call_of_a_batch_is_authorized_alone_and_a_role_without_the_rpc_is_refused_whole(guarded_stub):
    guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="acme/lee", facts=[pb.FactInput(text="Lee rows.")]),
                             metadata=_metadata("acme-app"))
    guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="globex/kim", facts=[pb.FactInput(text="Kim's secret.")]),
                             metadata=_metadata("globex-app"))
    profile = pb.KvProfile(model="m", model_hash="m", kv_dtype="float32", tokenizer_hash="t", header_hash="h",
                           recipe="chunked-rope-cwe", recipe_version=1)
    profile.profile_id = kv_profile_id(profile)
    batch = pb.RetrieveAndStageBatchRequest(calls=[
        pb.RetrieveAndStageRequest(user_id=user_id, query="what?", top_k=3, profile=profile, node_id="n")
        for user_id in ("acme/lee", "globex/kim")])
    results = guarded_stub.RetrieveAndStageBatch(batch, metadata=_metadata("acme-nodes")).results
    assert [fact.text for fact in results[0].response.facts] == ["Lee rows."]
    assert results[1].code == grpc.StatusCode.PERMISSION_DENIED.value[0] and not results[1].response.facts
    assert "globex/kim" in results[1].message and "acme-nodes" in results[1].message
    with pytest.raises(grpc.RpcError) as error:
        guarded_stub.RetrieveAndStageBatch(batch, metadata=_metadata("acme-app"))
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_service_wide_tier_figures_are_hidden_from_a_tenants_credential(guarded_stub):
    tenant = guarded_stub.GetStats(pb.GetStatsRequest(user_id="acme/maya"), metadata=_metadata("acme-app"))
    assert list(tenant.tiers) == []
    operator = guarded_stub.GetStats(pb.GetStatsRequest(), metadata=_metadata("ops"))
    assert {tier.name for tier in operator.tiers} >= {"disk"}


def test_service_keeps_health_open_to_probes_without_a_token(guarded_service):
    with guarded_service.channel() as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_worker_with_its_token_from_the_environment_computes_kv(guarded_service, guarded_stub, tiny_llama_dir,
                                                               monkeypatch):
    guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="acme/leo", facts=[pb.FactInput(text="Leo bakes bread.")]),
                             metadata=_metadata("acme-app"))
    monkeypatch.setenv(WORKER_TOKEN_ENV, TOKENS["workers"])
    # A process of its own: the token reaches the worker through its environment, as in a pod.
    finished = run_worker_process(guarded_service, tiny_llama_dir, "--worker-id", "workers/test")
    assert finished.returncode == 0, finished.stderr[-3000:]
    stats = guarded_stub.GetStats(pb.GetStatsRequest(), metadata=_metadata("workers"))
    # The worker's profile holds KV of every fact (a node's profile announced by another test may hold none).
    assert stats.facts in [profile.done for profile in stats.profiles]


def test_a_tenant_past_its_fact_quota_is_resource_exhausted_and_nothing_is_stored(guarded_stub):
    small = _metadata("small-app")
    guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="small/a", facts=[pb.FactInput(text="A rows."),
                                                                             pb.FactInput(text="A sails.")]),
                             metadata=small)
    guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="small/b", facts=[pb.FactInput(text="B knits.")]),
                             metadata=small)
    with pytest.raises(grpc.RpcError) as error:
        guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="small/c", facts=[pb.FactInput(text="C paints.")]),
                                 metadata=small)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota of 3" in error.value.details()
    assert _facts_of(guarded_stub, "small/c") == []
    guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="small/a", facts=[pb.FactInput(text="A rows.")]),
                             metadata=small)  # an unchanged fact creates nothing, so it is not held back


def test_a_tenant_whose_stored_kv_reached_its_quota_cannot_add_facts(guarded_service, guarded_stub, tiny_llama_dir,
                                                                     monkeypatch):
    kv_app = _metadata("kv-app")
    guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="kvq/ann", facts=[pb.FactInput(text="Ann hikes.")]),
                             metadata=kv_app)
    monkeypatch.setenv(WORKER_TOKEN_ENV, TOKENS["workers"])
    run_worker(guarded_service, tiny_llama_dir, "--worker-id", "workers/test")
    with pytest.raises(grpc.RpcError) as error:
        guarded_stub.IngestFacts(pb.IngestFactsRequest(user_id="kvq/bob", facts=[pb.FactInput(text="Bob swims.")]),
                                 metadata=kv_app)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "bytes of fact KV" in error.value.details()
    assert _facts_of(guarded_stub, "kvq/bob") == []
