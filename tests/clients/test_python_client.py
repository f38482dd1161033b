"""The Python client package (clients/python) against real memory services: every app- and operator-facing call,
ingest split under the service's limits (also a service whose limit is below the client's), paging, errors that
carry the status, the field and the request id, the bearer token, the asyncio client, and the package installed
alone in a fresh venv ingesting and searching 10,000 facts in one call."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import grpc
import pytest

from harness.memory_service import MemoryServiceProcess
from inferscale_client import SERVING, AsyncMemoryClient, ClientSettings, InferScaleError, MemoryClient
from inferscale_client import settings as client_settings
from inferscale_kv import call_credentials
from tests.conftest import own_memory_service
from tests.memory_service.test_access import CREDENTIALS, TOKENS, _write
from tests.stacks import Users

USERS = Users(__name__)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def memory(memory_service: MemoryServiceProcess):
    with MemoryClient(memory_service=memory_service.address, timeout_s=120) as client:
        yield client


def test_facts_go_in_over_as_many_calls_as_the_limits_need_and_come_back_page_by_page(memory) -> None:
    user = USERS("many")
    calls: list[int] = []
    facts = [f"Shelf {index} holds jar {index * 7}." for index in range(2500)]
    outcomes = memory.add_facts(user, facts, progress=calls.append)
    assert calls == [1000, 1000, 500] and len(outcomes) == 2500
    listed = list(memory.list_facts(user, page_size=1000))
    assert sorted(fact.text for fact in listed) == sorted(facts)
    assert memory.search(user, "jar 6993", top_k=1, retrieval="keyword")[0].fact.text == "Shelf 999 holds jar 6993."
    deleted = memory.delete_facts(user, [outcomes[0].fact_id, "no-such-fact"])
    assert (deleted.facts_deleted, list(deleted.not_found_fact_ids)) == (1, ["no-such-fact"])
    assert memory.stats(user).facts == 2499
    assert memory.delete_user(user).facts_deleted == 2499
    assert memory.health() == SERVING


def test_facts_as_mappings_and_turns_keep_their_ids_timestamps_and_metadata(memory) -> None:
    user = USERS("mapped")
    assert memory.add_turns(user, [{"turn_id": "t1", "seq": 1, "session_id": "s1", "speaker": "Maya",
                                    "text": "My sister moved to Porto."}]) == 1
    memory.add_facts(user, [{"fact_id": "sister", "text": "Maya's sister lives in Porto.", "source_turn_id": "t1",
                             "timestamp": "2026-05-01T10:00:00Z", "metadata": {"topic": "family"}}])
    (fact,) = memory.list_facts(user)
    assert (fact.fact_id, fact.source_turn_id, dict(fact.metadata)) == ("sister", "t1", {"topic": "family"})
    assert fact.timestamp.ToJsonString() == "2026-05-01T10:00:00Z"


def test_a_refused_call_raises_with_its_status_field_and_request_id(memory) -> None:
    with pytest.raises(InferScaleError) as raised:
        memory.add_facts(USERS("refused"), ["fine", "   "])
    error = raised.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.field == "facts[1].text"
    assert len(error.request_id) == 32 and error.request_id in str(error)
    with pytest.raises(InferScaleError) as raised:
        memory.delete_user(USERS("nobody"))
    assert raised.value.code == grpc.StatusCode.NOT_FOUND


def test_a_service_with_a_lower_limit_than_the_clients_gets_smaller_calls(tmp_path_factory) -> None:
    calls: list[int] = []
    with (own_memory_service(tmp_path_factory, "client-limits", "--max-facts-per-call", "100") as service,
          MemoryClient(memory_service=service.address) as client):
        assert len(client.add_facts("u", [f"fact {index}" for index in range(250)], progress=calls.append)) == 250
    assert calls == [100, 100, 50]  # 250 refused as more than the service's 100 per call: split at its limit


def test_a_quota_refusal_is_raised_whole_not_split_into_a_partial_write(tmp_path_factory) -> None:
    """Also RESOURCE_EXHAUSTED on `facts`, but not a per-call limit: the call is refused and nothing of it stored."""
    with (own_memory_service(tmp_path_factory, "client-quota", "--max-facts-per-user", "5") as service,
          MemoryClient(memory_service=service.address) as client):
        with pytest.raises(InferScaleError) as raised:
            client.add_facts("u", [f"fact {index}" for index in range(8)])
        assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert list(client.list_facts("u")) == []


def test_the_token_is_sent_with_every_call(tmp_path_factory) -> None:
    credentials = _write(tmp_path_factory.mktemp("client-credentials"), CREDENTIALS)
    with own_memory_service(tmp_path_factory, "client-auth", "--auth-file", str(credentials)) as service:
        with MemoryClient(memory_service=service.address, token=TOKENS["acme-app"]) as client:
            client.add_facts("acme/ines", ["Ines rows."])
            assert [fact.text for fact in client.list_facts("acme/ines")] == ["Ines rows."]
            with pytest.raises(InferScaleError) as raised:
                client.add_facts("globex/ana", ["not hers"])
            assert raised.value.code == grpc.StatusCode.PERMISSION_DENIED
        with MemoryClient(memory_service=service.address) as anonymous:
            with pytest.raises(InferScaleError) as raised:
                anonymous.search("acme/ines", "rows")
            assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED


async def test_the_asyncio_client_makes_the_same_calls(memory_service) -> None:
    user = USERS("async")
    async with AsyncMemoryClient(memory_service=memory_service.address, timeout_s=60) as client:
        await client.add_facts(user, [f"Async fact {index}." for index in range(30)], batch_size=7)
        listed = [fact async for fact in client.list_facts(user, page_size=4)]
        assert len(listed) == 30
        assert (await client.search(user, "Async fact 17.", top_k=1, retrieval="keyword"))[0].fact.text \
            == "Async fact 17."
        assert (await client.stats(user)).facts == 30
        assert await client.health() == SERVING
        with pytest.raises(InferScaleError) as raised:  # the status and field of an asyncio call's error too
            await client.add_facts(user, ["fine", ""])
        assert (raised.value.code, raised.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, "facts[1].text")
        assert (await client.delete_user(user)).facts_deleted == 30


def test_settings_come_from_inferscale_variables(monkeypatch) -> None:
    monkeypatch.setenv("INFERSCALE_MEMORY_SERVICE", "dns:///memory.example:50051")
    monkeypatch.setenv("INFERSCALE_MEMORY_SERVICE_TIMEOUT_S", "5")
    monkeypatch.setenv("INFERSCALE_TLS_CERT_FILE", "/the/service/own.crt")  # the service's variable: not the client's
    settings = ClientSettings.from_env(token="t")
    assert (settings.memory_service, settings.timeout_s, settings.token) == ("dns:///memory.example:50051", 5.0, "t")
    assert settings.tls_cert_file == "" and settings.credentials() is None
    with pytest.raises(ValueError, match="give both"):
        ClientSettings(tls_cert_file="client.crt").credentials()


def test_the_client_retries_as_the_nodes_and_workers_do() -> None:
    nodes = json.loads(dict(call_credentials.REPLICA_OPTIONS)["grpc.service_config"])["methodConfig"][0]
    assert nodes["retryPolicy"] == client_settings.RETRY_POLICY
    assert set(client_settings.RETRIED_METHODS) <= {name["method"] for name in nodes["name"]}


def test_the_package_installed_alone_ingests_and_searches_ten_thousand_facts(memory_service, memory,
                                                                             tmp_path) -> None:
    """`pip install clients/python` in a fresh venv (grpcio and protobuf only), then one add_facts call of 10,000
    facts and a search, from a process of its own. Its users are deleted after: their facts are queued for KV in the
    session's service, whose next worker run would encode them all."""
    try:
        _ten_thousand_facts_from_a_venv(memory_service, tmp_path)
    finally:
        for user in (USERS("ten-thousand"), USERS("ten-thousand-cli")):
            with contextlib.suppress(InferScaleError):  # nothing stored under it (the test failed before)
                memory.delete_user(user)


def _ten_thousand_facts_from_a_venv(memory_service: MemoryServiceProcess, tmp_path: Path) -> None:
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    installed = subprocess.run([python, "-m", "pip", "install", "--quiet", str(ROOT / "clients" / "python")],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    script = textwrap.dedent(f"""
        import importlib.metadata, re
        from inferscale_client import MemoryClient
        import inferscale_client
        assert "/venv/" in inferscale_client.__file__, inferscale_client.__file__  # the installed package
        requires = sorted(re.split("[<>=!~;, ]", r)[0] for r in importlib.metadata.requires("inferscale-client")
                          if "extra ==" not in r)  # the cli extra's progress bar aside
        assert requires == ["grpcio", "protobuf"], requires
        with MemoryClient(memory_service={memory_service.address!r}, timeout_s=300) as memory:
            outcomes = memory.add_facts({USERS("ten-thousand")!r},
                                        [f"Box {{i}} sits on rack {{i * 3}}." for i in range(10_000)])
            hit = memory.search({USERS("ten-thousand")!r}, "rack 29997", top_k=1, retrieval="keyword")[0]
            print(len(outcomes), hit.fact.text)
    """)
    ran = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.split(maxsplit=1) == ["10000", "Box 9999 sits on rack 29997.\n"]
    # The command line it installs does the same from a JSON Lines file.
    lines = tmp_path / "facts.jsonl"
    lines.write_text("".join(json.dumps({"text": f"Crate {i} sits on shelf {i * 3}."}) + "\n" for i in range(10_000)))
    command = [tmp_path / "venv" / "bin" / "inferscale", "--memory-service", memory_service.address, "--timeout-s",
               "300"]
    user = USERS("ten-thousand-cli")
    added = subprocess.run([*command, "--json", "facts", "add", user, "--file", str(lines)], capture_output=True,
                           text=True, timeout=900)
    assert added.returncode == 0 and len(json.loads(added.stdout)) == 10_000, added.stderr[-3000:]
    found = subprocess.run([*command, "facts", "search", user, "shelf 29997", "--top-k", "1", "--retrieval",
                            "keyword"], capture_output=True, text=True, timeout=300)
    assert "Crate 9999 sits on shelf 29997." in found.stdout, found.stderr[-3000:]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`inferscale ...` as a shell runs it (python -m inferscale_client.cli, the console script's module)."""
    return subprocess.run([sys.executable, "-m", "inferscale_client.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "clients" / "python" / "src"),
                                            **(env or {})})


def test_the_command_line_ingests_a_json_lines_file_lists_searches_and_deletes(memory_service, tmp_path) -> None:
    user = USERS("cli")
    facts = tmp_path / "facts.jsonl"
    facts.write_text("\n".join(json.dumps(fact) for fact in (
        [{"fact_id": f"jar-{index}", "text": f"Jar {index} holds {index * 11} beads."} for index in range(40)]
        + ["Maya keeps bees."])) + "\n")
    address = {"INFERSCALE_MEMORY_SERVICE": memory_service.address}  # every flag also from its variable
    added = _cli("--json", "facts", "add", user, "--file", str(facts), "--batch-size", "16", env=address)
    assert added.returncode == 0, added.stderr
    assert len(json.loads(added.stdout)) == 41 and "fact/s" in added.stderr  # the progress bar, on stderr
    listed = json.loads(_cli("--memory-service", memory_service.address, "--json", "facts", "list", user,
                             "--page-size", "10").stdout)
    assert sorted(fact["fact_id"] for fact in listed if fact["fact_id"].startswith("jar-")) == \
        sorted(f"jar-{index}" for index in range(40))
    table = _cli("facts", "search", user, "beads 297", "--retrieval", "keyword", env={**address,
                                                                                     "INFERSCALE_TOP_K": "1"})
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split() == ["rank", "score", "fact_id", "version", "text"] and "Jar 27 holds 297 beads." in row
    turns = tmp_path / "turns.json"
    turns.write_text(json.dumps([{"turn_id": "t1", "seq": 1, "session_id": "s", "speaker": "Maya", "text": "Hi."}]))
    assert "turns_written: 1" in _cli("turns", "add", user, "--file", str(turns), env=address).stdout
    assert "facts_deleted: 1" in _cli("facts", "delete", user, "jar-0", env=address).stdout
    assert "facts: 40" in _cli("stats", user, env=address).stdout
    assert _cli("health", env=address).stdout.strip() == "status: SERVING"
    assert "facts_deleted: 40" in _cli("users", "delete", user, env=address).stdout


def test_the_command_line_reports_a_refusal_with_its_status_and_exit_code(memory_service) -> None:
    refused = _cli("--memory-service", memory_service.address, "facts", "add", USERS("cli-refused"), "ok", " ")
    assert refused.returncode == 1 and "INVALID_ARGUMENT: facts[1].text" in refused.stderr
    assert _cli("facts").returncode == 2  # a wrong command line
