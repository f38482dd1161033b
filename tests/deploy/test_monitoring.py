"""deploy/monitoring/ offline: the generated files are current, the PrometheusRule carries exactly the plain rules,
promtool accepts the rules and their unit tests fire and stay quiet for every alert, the dashboards are what Grafana
imports, and the scraping objects (PodMonitors, the plain scrape configuration, deploy/k8s's annotations) reach the
ports the pods expose under the job labels the alerts and dashboards select on. The same queries against real
processes: test_monitoring_live.py."""

from __future__ import annotations

import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import yaml

from tests.deploy.monitoring_files import (
    ALERT_TESTS_FILE,
    DASHBOARD_FILES,
    JOBS,
    MONITORING,
    POD_MONITORS_FILE,
    PROMETHEUS_RULE_FILE,
    REPO_ROOT,
    RULES_FILE,
    SCRAPE_CONFIG_FILE,
    alert_rules,
    all_panels,
    dashboards,
    panel_queries,
    rule_groups,
)
from tests.deploy.promql import GRAFANA_VARIABLES, selectors, with_grafana_variables

K8S = REPO_ROOT / "deploy" / "k8s"
NAMESPACE = "inferscale"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Fields of the operator's CRDs (monitoring.coreos.com/v1) these objects may use.
POD_MONITOR_SPEC = {"jobLabel", "podTargetLabels", "podMetricsEndpoints", "selector", "namespaceSelector",
                    "sampleLimit", "targetLimit", "attachMetadata"}
POD_METRICS_ENDPOINT = {"port", "portNumber", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                        "honorTimestamps", "relabelings", "metricRelabelings", "params", "enableHttp2"}
RULE_GROUP = {"name", "interval", "rules", "limit", "partial_response_strategy", "query_offset"}
RULE = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
SEVERITIES = {"warning", "critical"}
PANEL_TYPES = {"row", "timeseries", "stat"}


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is not installed: `make test` installs Debian's prometheus package"
    return path


def _manifest_objects() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _workloads() -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in _manifest_objects() if obj["kind"] in ("Deployment", "StatefulSet")}


def _container_ports(workload: dict) -> dict[str, int]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


def _scraped_workloads() -> dict[str, dict]:
    return {name: workload for name, workload in _workloads().items()
            if workload["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"}


def _job(workload: dict) -> str:
    """The job label its pods are scraped under: their app.kubernetes.io/name (both routers' pods share one)."""
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]


def _pod_monitors() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(POD_MONITORS_FILE.read_text()) if doc]


def test_generated_files_are_up_to_date():
    result = subprocess.run([sys.executable, str(MONITORING / "generate.py"), "--check"], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def test_prometheus_rule_carries_exactly_the_plain_rules():
    rule = yaml.safe_load(PROMETHEUS_RULE_FILE.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["metadata"]["namespace"] == NAMESPACE and rule["metadata"]["name"]
    assert set(rule["spec"]) == {"groups"}
    assert rule["spec"]["groups"] == rule_groups()
    for group in rule["spec"]["groups"]:
        assert set(group) <= RULE_GROUP, group["name"]
        for entry in group["rules"]:
            assert set(entry) <= RULE, entry


def test_promtool_accepts_the_rules_in_both_forms(tmp_path: Path):
    extracted = tmp_path / "prometheusrule-groups.yaml"
    extracted.write_text(yaml.safe_dump({"groups": yaml.safe_load(PROMETHEUS_RULE_FILE.read_text())["spec"]["groups"]}))
    for path in (RULES_FILE, extracted):
        result = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True,
                                timeout=60, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_every_alert_has_a_severity_a_summary_and_says_what_to_look_at_first():
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names))
    for rule in alert_rules():
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]
        assert "Look first at" in rule["annotations"]["description"], rule["alert"]
    # The signals the alerts exist for.
    named = {selector.metric for rule in alert_rules() for selector in selectors(rule["expr"])}
    assert {"inferscale_kv_queue_lag_seconds", "inferscale_connector_load_failures_total",
            "inferscale_connector_plans_refused_total", "inferscale_rpc_requests_total",
            "inferscale_node_stage_seconds_bucket", "inferscale_node_memory_dropped_total", "up"} <= named


def test_dropped_memory_is_watched_by_the_reasons_the_node_counts():
    """The node's drop reasons as the queries select them: only reasons the middleware counts, a deadline alert and
    an unreachable alert of their own, and an alert on every reason together."""
    from inference_node.retrieval import DROP_DEADLINE, DROP_REASONS, DROP_UNAVAILABLE

    metric = "inferscale_node_memory_dropped_total"
    reasons_by_alert: dict[str, set[str]] = {}
    for where, found in _all_selectors():
        for selector in found:
            if selector.metric != metric:
                continue
            matchers = [matcher for matcher in selector.matchers if matcher.label == "reason"]
            assert all(matcher.op == "=" and matcher.value in DROP_REASONS for matcher in matchers), where
            reasons_by_alert.setdefault(where, set()).update(matcher.value for matcher in matchers)
    alerts = {rule["alert"] for rule in alert_rules()}
    watched = {frozenset(reasons) for where, reasons in reasons_by_alert.items() if where in alerts}
    assert {frozenset({DROP_DEADLINE}), frozenset({DROP_UNAVAILABLE}), frozenset()} <= watched  # () = every reason


def test_latency_thresholds_follow_the_node_default_deadline():
    from inference_node.__main__ import build_parser

    deadline = build_parser().get_default("retrieve_timeout_s")
    generate = runpy.run_path(str(MONITORING / "generate.py"), run_name="deploy_monitoring_generate")
    assert deadline == generate["DEADLINE_S"]
    slow = next(rule for rule in alert_rules() if rule["alert"] == "InferScaleRetrieveAndStageSlow")
    assert slow["expr"].endswith(f"> {deadline / 2:g}")


def test_promtool_unit_tests_fire_and_stay_quiet_for_every_alert(tmp_path: Path):
    cases = yaml.safe_load(ALERT_TESTS_FILE.read_text())
    firing = {case["alertname"] for test in cases["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for test in cases["tests"] for case in test["alert_rule_test"]
             if not case["exp_alerts"]}
    names = {rule["alert"] for rule in alert_rules()}
    assert firing == names and quiet == names
    # The expected alerts name their summary, which carries the rendered value; descriptions are prose.
    groups = rule_groups()
    for group in groups:
        for rule in group["rules"]:
            del rule["annotations"]["description"]
    (tmp_path / RULES_FILE.name).write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    shutil.copy(ALERT_TESTS_FILE, tmp_path / ALERT_TESTS_FILE.name)
    result = subprocess.run([_promtool(), "test", "rules", ALERT_TESTS_FILE.name], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_dashboards_are_what_grafana_imports():
    assert [path.stem for path in DASHBOARD_FILES] == sorted(
        ["inferscale-overview", "inferscale-memory-service", "inferscale-inference-node"])
    uids = set()
    for name, dashboard in dashboards().items():
        assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36, name
        assert dashboard["title"] and re.fullmatch(r"[a-z0-9-]{1,40}", dashboard["uid"]), name
        assert dashboard["uid"] not in uids
        uids.add(dashboard["uid"])
        (variable,) = dashboard["templating"]["list"]
        assert (variable["name"], variable["type"], variable["query"]) == ("datasource", "datasource", "prometheus")
        panels = list(all_panels(dashboard["panels"]))
        ids = [panel["id"] for panel in panels]
        assert all(isinstance(panel_id, int) for panel_id in ids) and len(ids) == len(set(ids)), name
        taken: set[tuple[int, int]] = set()
        for panel in panels:
            where = f"{name} / {panel['title']}"
            assert panel["type"] in PANEL_TYPES, where
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, where
            cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                     for y in range(grid["y"], grid["y"] + grid["h"])}
            assert not cells & taken, f"{where} overlaps another panel"
            taken |= cells
            if panel["type"] == "row":
                continue
            assert panel["description"], where
            assert panel["fieldConfig"]["defaults"]["unit"], where
            assert panel["datasource"] == DATASOURCE, where
            assert panel["targets"], where
            assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"]), where
            for target in panel["targets"]:
                assert target["datasource"] == DATASOURCE, where
                assert selectors(with_grafana_variables(target["expr"])), where
        # No data source is named anywhere but through the variable (Grafana's built-in annotations aside).
        text = Path(MONITORING / "dashboards" / name).read_text()
        assert set(re.findall(r'"uid": "([^"]*)"', text)) == {"${datasource}", "-- Grafana --", dashboard["uid"]}


def test_dashboards_and_alerts_cover_what_the_issue_asks():
    named = {(query.dashboard, selector.metric) for query in panel_queries()
             for selector in selectors(with_grafana_variables(query.expr))}
    wanted = {
        "inferscale-memory-service.json": {
            "inferscale_rpc_requests_total", "inferscale_rpc_duration_seconds_bucket",
            "inferscale_embedding_duration_seconds_bucket", "inferscale_retrieval_duration_seconds_bucket",
            "inferscale_facts_stored", "inferscale_turns_stored", "inferscale_kv_queue_facts",
            "inferscale_kv_queue_lag_seconds", "inferscale_worker_facts_per_second",
            "inferscale_worker_device_memory_used_bytes", "inferscale_worker_device_utilization_percent",
            "inferscale_kv_tier_bytes", "inferscale_kv_tier_hits_total", "inferscale_kv_bytes_read_total",
            "inferscale_kv_bytes_served_total", "up"},
        "inferscale-inference-node.json": {
            "inferscale_node_memory_requests_total", "inferscale_connector_tokens_loaded_total",
            "vllm:prompt_tokens_total", "inferscale_connector_node_cache_hits_total",
            "inferscale_connector_async_loads_total", "inferscale_connector_load_failures_total",
            "inferscale_connector_plans_refused_total", "inferscale_node_stage_seconds_bucket",
            "inferscale_node_memory_dropped_total", "vllm:time_to_first_token_seconds_bucket",
            "vllm:request_queue_time_seconds_bucket"},
        "inferscale-overview.json": {
            "inferscale_connector_tokens_loaded_total", "vllm:time_to_first_token_seconds_bucket",
            "inferscale_node_stage_seconds_bucket", "inferscale_node_memory_dropped_total", "up"},
    }
    for dashboard, metrics in wanted.items():
        assert metrics <= {metric for name, metric in named if name == dashboard}, dashboard


def _all_selectors():
    for query in panel_queries():
        yield str(query), selectors(with_grafana_variables(query.expr))
    for rule in alert_rules():
        yield rule["alert"], selectors(rule["expr"])


def test_queries_name_only_the_scrape_jobs_and_real_grpc_codes():
    codes = {code.name for code in grpc.StatusCode}
    jobs = set()
    for where, found in _all_selectors():
        for selector in found:
            for matcher in selector.matchers:
                if matcher.label == "job":
                    assert matcher.op == "=", where
                    jobs.add(matcher.value)
                if matcher.label == "code":
                    assert set(matcher.value.split("|")) <= codes, where
    assert jobs == set(JOBS)
    assert set(GRAFANA_VARIABLES) >= {"$__rate_interval", "$__range"}


def test_pod_monitors_scrape_every_annotated_pod_on_its_metrics_port_under_its_job():
    monitors = _pod_monitors()
    scraped = _scraped_workloads()
    assert {monitor["metadata"]["name"] for monitor in monitors} == {_job(workload) for workload in scraped.values()} \
        == set(JOBS)
    for monitor in monitors:
        name = monitor["metadata"]["name"]
        assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
        assert monitor["metadata"]["namespace"] == NAMESPACE
        assert set(monitor["spec"]) <= POD_MONITOR_SPEC, name
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert set(endpoint) <= POD_METRICS_ENDPOINT, name
        for workload in [workload for workload in scraped.values() if _job(workload) == name]:
            template = workload["spec"]["template"]
            labels = template["metadata"]["labels"]
            assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
            assert labels[monitor["spec"]["jobLabel"]] == name  # the job label the alerts select on
            annotations = template["metadata"]["annotations"]
            assert _container_ports(workload)[endpoint["port"]] == int(annotations["prometheus.io/port"]), name
            assert endpoint["path"] == annotations["prometheus.io/path"] == "/metrics", name


def test_scrape_annotations_name_ports_the_pods_expose_and_the_worker_has_none():
    scraped = _scraped_workloads()
    assert {_job(workload) for workload in scraped.values()} == set(JOBS)
    for name, workload in scraped.items():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) in _container_ports(workload).values(), name
    from memory_service import config as service_config

    metrics_port = service_config.build_parser().get_default("metrics_port")
    assert _container_ports(scraped["memory-service"])["metrics"] == metrics_port == 9400
    node = scraped["inference-node"]["spec"]["template"]
    assert int(node["metadata"]["annotations"]["prometheus.io/port"]) == _container_ports(
        scraped["inference-node"])["http"]
    # Precompute workers serve no metrics (the memory service reports them): no port to scrape.
    from precompute_worker.__main__ import build_parser

    assert not [action for action in build_parser()._actions if "metrics" in action.dest]
    assert "annotations" not in _workloads()["precompute-worker"]["spec"]["template"]["metadata"]


def _relabel(labels: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus's relabelling (keep and replace), as the target's labels come out of it; None when dropped."""
    labels = dict(labels)
    for config in configs:
        value = config.get("separator", ";").join(labels.get(name, "") for name in config.get("source_labels", []))
        match = re.fullmatch(config.get("regex", "(.*)"), value)
        action = config.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                replacement = re.sub(r"\$\{?(\d+)\}?", r"\\\1", config.get("replacement", "$1"))
                result = match.expand(replacement)
                if result:
                    labels[config["target_label"]] = result
                else:
                    labels.pop(config["target_label"], None)
        else:
            raise AssertionError(f"relabel action {action} not simulated here")
    return labels


def _sanitized(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def test_plain_scrape_configuration_finds_the_annotated_pods_under_their_jobs(tmp_path: Path):
    snippet = yaml.safe_load(SCRAPE_CONFIG_FILE.read_text())
    (job,) = snippet["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": [NAMESPACE]}}]
    # Debian's Prometheus is built without Kubernetes discovery: promtool checks the rest of the job (relabelling
    # included) with static targets in its place, and the discovery's labels are simulated below.
    checked = {key: value for key, value in job.items() if key != "kubernetes_sd_configs"}
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"}, "rule_files": [str(RULES_FILE)],
                                      "scrape_configs": [{**checked, "static_configs": [{"targets": ["a:1"]}]}]}))
    result = subprocess.run([_promtool(), "check", "config", str(config)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout
    targets: dict[str, set[tuple[str, str, str]]] = {}
    for name, workload in _workloads().items():
        template = workload["spec"]["template"]
        for port in _container_ports(workload).values():  # the pod role yields one target per declared port
            meta = {"__address__": f"10.1.2.3:{port}", "__metrics_path__": "/metrics", "job": job["job_name"],
                    "__meta_kubernetes_namespace": NAMESPACE, "__meta_kubernetes_pod_name": f"{name}-0"}
            meta |= {f"__meta_kubernetes_pod_label_{_sanitized(key)}": value
                     for key, value in template["metadata"]["labels"].items()}
            meta |= {f"__meta_kubernetes_pod_annotation_{_sanitized(key)}": value
                     for key, value in template["metadata"].get("annotations", {}).items()}
            target = _relabel(meta, job["relabel_configs"])
            if target is not None:
                targets.setdefault(name, set()).add(
                    (target["job"], target["__address__"], target["__metrics_path__"]))
    annotated = _scraped_workloads()
    assert set(targets) == set(annotated)
    for name, found in targets.items():
        annotations = annotated[name]["spec"]["template"]["metadata"]["annotations"]
        assert found == {(_job(annotated[name]), f"10.1.2.3:{annotations['prometheus.io/port']}",
                          annotations["prometheus.io/path"])}


def test_operator_objects_live_apart_from_deploy_k8s_and_kustomize_builds_them():
    assert not [obj for obj in _manifest_objects() if obj["apiVersion"].startswith("monitoring.coreos.com")]
    root = yaml.safe_load((REPO_ROOT / "deploy" / "kustomization.yaml").read_text())
    assert all(resource.startswith("k8s/") for resource in root["resources"])
    result = subprocess.run(["kubectl", "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert all(obj["metadata"]["namespace"] == NAMESPACE for obj in built)
    by_kind: dict[str, list[dict]] = {}
    for obj in built:
        by_kind.setdefault(obj["kind"], []).append(obj)
    assert sorted(by_kind) == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    assert {monitor["metadata"]["name"]: monitor["spec"] for monitor in by_kind["PodMonitor"]} == {
        monitor["metadata"]["name"]: monitor["spec"] for monitor in _pod_monitors()}
    (rule,) = by_kind["PrometheusRule"]
    assert rule["spec"]["groups"] == rule_groups()
    # One ConfigMap per dashboard, labelled for Grafana's dashboard sidecar, each well inside what `kubectl apply`
    # keeps in its last-applied annotation (256 KiB).
    dashboards_found = {}
    for config_map in by_kind["ConfigMap"]:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        (file_name, content), = config_map["data"].items()
        dashboards_found[file_name] = content
        assert len(content) < 128 * 1024, file_name
    assert dashboards_found == {path.name: path.read_text() for path in DASHBOARD_FILES}
