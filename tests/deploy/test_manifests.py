"""deploy/: the Kubernetes manifests validate offline, and every port, probe, flag and environment name in them is
one the programs accept; the memory service runs as replicas sharing PostgreSQL and an object store, whose in-cluster
stand-ins the shared-state Secret names; the inference nodes run as a fleet behind vLLM's router, which finds them by
label and hashes the header they check, and a second router balances the requests naming no user by load, the
gateway's route (deploy/gateway) telling the two apart; the Dockerfiles lint clean and name only paths and programs
that exist."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from inferscale_kv.call_credentials import NODE_TOKEN_ENV, WORKER_TOKEN_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO_ROOT / "deploy" / "k8s").glob("*.yaml"))
DOCKERFILES = sorted((REPO_ROOT / "deploy" / "docker").glob("*.Dockerfile"))
KUBERNETES_VERSION = "1.31.0"
NAMESPACE = "inferscale"
WORKLOAD_KINDS = ("StatefulSet", "Deployment")
SHARED_STATE_SECRET = "memory-service-shared-state"
# The in-cluster stores for trying it out: third-party images, not built from deploy/docker/.
STORES = ("postgres", "seaweedfs")
OBJECT_STORE_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
GATEWAY_MANIFESTS = sorted((REPO_ROOT / "deploy" / "gateway").glob("*.yaml"))
# Fields of the Gateway API's HTTPRoute (gateway.networking.k8s.io/v1, a CRD kubernetes-validate has no schema for)
# that deploy/gateway may use, and the match types of its standard channel.
HTTP_ROUTE_SPEC = {"parentRefs", "hostnames", "rules"}
PARENT_REF = {"group", "kind", "namespace", "name", "sectionName", "port"}
HTTP_ROUTE_RULE = {"name", "matches", "filters", "backendRefs", "timeouts", "retry", "sessionPersistence"}
HTTP_ROUTE_MATCH = {"path", "headers", "queryParams", "method"}
PATH_MATCH_TYPES = {"Exact", "PathPrefix", "RegularExpression"}
HEADER_MATCH = {"type", "name", "value"}
HEADER_MATCH_TYPES = {"Exact", "RegularExpression"}
BACKEND_REF = {"group", "kind", "name", "namespace", "port", "weight", "filters"}


def _objects_by_file() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _objects() -> list[dict]:
    return [obj for _, obj in _objects_by_file()]


def _find(kind: str, name: str) -> dict:
    matches = [obj for obj in _objects() if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def _container(kind: str, name: str) -> dict:
    (container,) = _find(kind, name)["spec"]["template"]["spec"]["containers"]
    return container


def _environment(container: dict) -> dict[str, str]:
    """The container's environment as the program sees it: its ConfigMaps and Secrets (in order, a later one winning),
    then its own values (a Secret's key resolved; the downward API's and optional Secrets' as placeholders)."""
    environment: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            environment.update(_find("ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            environment.update(_find("Secret", source["secretRef"]["name"])["stringData"])
    for entry in container.get("env", []):
        reference = entry.get("valueFrom", {}).get("secretKeyRef")
        if reference and not reference.get("optional"):
            environment[entry["name"]] = _find("Secret", reference["name"])["stringData"][reference["key"]]
        else:
            environment[entry["name"]] = entry.get("value", "from-the-downward-api-or-an-optional-secret")
    return environment


def _memory(quantity: str) -> int:
    """A Kubernetes memory quantity (binary suffixes, as the manifests write them) in bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", quantity)
    assert match is not None, quantity
    number, suffix = match.groups()
    return int(number) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[suffix]


def _service_port(name: str, port_name: str) -> int:
    return next(port["port"] for port in _find("Service", name)["spec"]["ports"] if port["name"] == port_name)


def _container_ports(container: dict) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _unknown_prefixed_variables(environment: dict[str, str], prefix: str, parser) -> list[str]:
    """Variables with the program's prefix that name none of its flags nor its token (a typo the program would
    ignore)."""
    destinations = {action.dest for action in parser._actions}
    return [name for name in environment if name.startswith(prefix) and name not in (WORKER_TOKEN_ENV, NODE_TOKEN_ENV)
            and name[len(prefix):].lower() not in destinations]


def _parser_under_manifest_environment(kind: str, name: str, command: list[str], module: str, monkeypatch):
    """The program's container and its flag parser, built with the container's environment as the program sees
    it; fails on an environment variable with the program's prefix that names none of its flags."""
    container = _container(kind, name)
    assert container["command"] == command
    environment = _environment(container)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    program = importlib.import_module(module)
    parser = program.build_parser()
    assert _unknown_prefixed_variables(environment, program.ENV_PREFIX, parser) == []
    return container, parser


def test_manifests_pass_kubernetes_validate_strict():
    result = subprocess.run([_bin("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, *map(str, MANIFESTS)],
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(_objects())


def test_apply_order_creates_the_namespace_first_and_everything_lives_in_it():
    first = next(yaml.safe_load_all(MANIFESTS[0].read_text()))
    assert first["kind"] == "Namespace" and first["metadata"]["name"] == NAMESPACE
    namespaced = [obj for obj in _objects() if obj["kind"] != "Namespace"]
    assert namespaced and all(obj["metadata"].get("namespace") == NAMESPACE for obj in namespaced)


def _referenced_settings(pod: dict) -> set[tuple[str, str, bool]]:
    """(kind, name, optional) of every ConfigMap and Secret a pod reads."""
    references = set()
    for container in pod["containers"]:
        for source in container.get("envFrom", []):
            for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                if key in source:
                    references.add((kind, source[key]["name"], bool(source[key].get("optional"))))
        for entry in container.get("env", []):
            for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                if key in entry.get("valueFrom", {}):
                    reference = entry["valueFrom"][key]
                    references.add((kind, reference["name"], bool(reference.get("optional"))))
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            references.add(("Secret", volume["secret"]["secretName"], bool(volume["secret"].get("optional"))))
        if "configMap" in volume:
            references.add(("ConfigMap", volume["configMap"]["name"], bool(volume["configMap"].get("optional"))))
    return references


def test_apply_order_creates_settings_and_secrets_before_the_pods_that_read_them():
    defined_in = {(obj["kind"], obj["metadata"]["name"]): MANIFESTS.index(path) for path, obj in _objects_by_file()}
    for path, obj in _objects_by_file():
        if obj["kind"] not in WORKLOAD_KINDS:
            continue
        for kind, name, optional in _referenced_settings(obj["spec"]["template"]["spec"]):
            if optional and (kind, name) not in defined_in:  # created by hand when wanted (deploy/README.md)
                continue
            assert defined_in[(kind, name)] < MANIFESTS.index(path), (obj["metadata"]["name"], kind, name)


def test_memory_service_config_loader_accepts_the_manifest_and_serves_on_its_ports(monkeypatch):
    from memory_service import config as service_config

    container, _ = _parser_under_manifest_environment("Deployment", "memory-service",
                                                      ["python", "-m", "memory_service"], "memory_service.config",
                                                      monkeypatch)
    loaded = service_config.load_config(container.get("args", []))
    loaded.validate()
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    commented = dict(re.findall(r"# (INFERSCALE_\w+): (\S+)", (REPO_ROOT / "deploy/k8s/10-config.yaml").read_text()))
    assert set(commented) == {"INFERSCALE_AUTH_FILE", "INFERSCALE_TLS_CERT_FILE", "INFERSCALE_TLS_KEY_FILE",
                              "INFERSCALE_TLS_CLIENT_CA_FILE", "INFERSCALE_USER_TOKEN_PUBLIC_KEY_FILE",
                              "INFERSCALE_USER_TOKEN_ISSUER"}
    for variable, path in commented.items():  # each commented-out setting names a flag; a file, one in a mount
        assert not variable.endswith("_FILE") or Path(path).parent.as_posix() in mounts, variable
    assert _unknown_prefixed_variables(commented, service_config.ENV_PREFIX, service_config.build_parser()) == []
    ports = _container_ports(container)
    assert ports == {"grpc": loaded.port, "metrics": loaded.metrics_port, "health": loaded.health_port}
    assert str(loaded.data_dir) in mounts
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # plaintext, whether or not the API is TLS
        assert container[probe]["grpc"]["port"] == loaded.health_port, probe
    from memory_service.server import SERVICE_NAME

    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    annotations = _find("Deployment", "memory-service")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == loaded.metrics_port


def test_memory_service_reads_shared_state_from_the_secret_and_shares_it_between_replicas(monkeypatch):
    """Every key of the Secret is a flag's environment name or the object store's credentials, and with the Secret the
    service runs on PostgreSQL and an S3 store (never on each pod's own emptyDir)."""
    from memory_service import config as service_config

    secret = _find("Secret", SHARED_STATE_SECRET)
    assert "data" not in secret
    keys = set(secret["stringData"])
    assert keys == {"INFERSCALE_COORDINATION_URL", "INFERSCALE_STORE_URI", "INFERSCALE_S3_ENDPOINT",
                    "INFERSCALE_S3_REGION", "INFERSCALE_S3_ALLOW_HTTP", *OBJECT_STORE_CREDENTIALS}
    parser = service_config.build_parser()
    assert _unknown_prefixed_variables(secret["stringData"], service_config.ENV_PREFIX, parser) == []
    assert {key for key in keys if not key.startswith(service_config.ENV_PREFIX)} == set(OBJECT_STORE_CREDENTIALS)
    container = _container("Deployment", "memory-service")
    sources = [source["secretRef"] for source in container["envFrom"] if "secretRef" in source]
    assert sources == [{"name": SHARED_STATE_SECRET}]  # required: no pod starts without it

    for variable, value in _environment(container).items():
        monkeypatch.setenv(variable, value)
    loaded = service_config.load_config(container.get("args", []))
    assert loaded.coordination_url.startswith("postgresql://")
    assert loaded.store_uri.startswith("s3://")
    assert loaded.s3_allow_http is (urlsplit(loaded.s3_endpoint).scheme == "http")
    from memory_service.object_store import S3Settings

    options = S3Settings(loaded.s3_endpoint, loaded.s3_region, loaded.s3_allow_http).storage_options()
    assert options["aws_access_key_id"] == secret["stringData"]["AWS_ACCESS_KEY_ID"]
    assert options["aws_secret_access_key"] == secret["stringData"]["AWS_SECRET_ACCESS_KEY"]


def test_shared_state_secret_points_at_the_in_cluster_stores_with_their_credentials():
    shared = _find("Secret", SHARED_STATE_SECRET)["stringData"]
    coordination = urlsplit(shared["INFERSCALE_COORDINATION_URL"])
    postgres = _find("Secret", "postgres-credentials")["stringData"]
    assert (coordination.hostname, coordination.port) == ("postgres", _service_port("postgres", "postgres"))
    assert (coordination.username, coordination.password, coordination.path.lstrip("/")) == (
        postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"], postgres["POSTGRES_DB"])
    assert [source["secretRef"]["name"] for source in _container("StatefulSet", "postgres")["envFrom"]] == [
        "postgres-credentials"]

    endpoint = urlsplit(shared["INFERSCALE_S3_ENDPOINT"])
    assert (endpoint.hostname, endpoint.port) == ("seaweedfs", _service_port("seaweedfs", "s3"))
    seaweedfs = _container("StatefulSet", "seaweedfs")
    assert seaweedfs["args"][0] == "mini"
    buckets = next(arg.split("=", 1)[1] for arg in seaweedfs["args"] if arg.startswith("-bucket="))
    assert urlsplit(shared["INFERSCALE_STORE_URI"]).hostname in buckets.split(",")
    s3_port = next(arg.split("=", 1)[1] for arg in seaweedfs["args"] if arg.startswith("-s3.port="))
    assert int(s3_port) == _container_ports(seaweedfs)["s3"]
    # SeaweedFS's admin identity is the memory service's key pair, from the same Secret.
    for variable in OBJECT_STORE_CREDENTIALS:
        entry = next(entry for entry in seaweedfs["env"] if entry["name"] == variable)
        assert entry["valueFrom"]["secretKeyRef"] == {"name": SHARED_STATE_SECRET, "key": variable}
    # The stores come up before the memory service in apply order.
    order = {obj["metadata"]["name"]: MANIFESTS.index(path) for path, obj in _objects_by_file()
             if obj["kind"] in WORKLOAD_KINDS}
    assert order["postgres"] < order["memory-service"] and order["seaweedfs"] < order["memory-service"]


def test_in_cluster_stores_keep_their_data_on_a_volume_and_probe_their_own_ports():
    for name, data_path in (("postgres", "/var/lib/postgresql/data"), ("seaweedfs", "/data")):
        statefulset = _find("StatefulSet", name)
        assert statefulset["spec"]["replicas"] == 1
        (claim,) = statefulset["spec"]["volumeClaimTemplates"]
        container = _container("StatefulSet", name)
        assert {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}[data_path] == \
            claim["metadata"]["name"], name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "httpGet" in container[probe]:
                assert container[probe]["httpGet"]["port"] in _container_ports(container), (name, probe)
            else:
                assert "pg_isready" in " ".join(container[probe]["exec"]["command"]), (name, probe)
    postgres = _environment(_container("StatefulSet", "postgres"))
    # The volume's root may hold lost+found; initdb needs an empty directory.
    assert Path(postgres["PGDATA"]).parent == Path("/var/lib/postgresql/data")


def test_postgres_accepts_the_connections_of_the_most_replicas_the_autoscaler_allows():
    from memory_service.sql import PostgresDatabase

    per_replica = inspect.signature(PostgresDatabase.__init__).parameters["max_connections"].default
    args = _container("StatefulSet", "postgres")["args"]
    settings = dict(args[index + 1].split("=", 1) for index, arg in enumerate(args) if arg == "-c")
    most_replicas = _find("HorizontalPodAutoscaler", "memory-service")["spec"]["maxReplicas"]
    assert int(settings["max_connections"]) >= per_replica * most_replicas + 10  # + psql, monitoring


def test_memory_service_scales_out_as_a_deployment_with_a_disruption_budget_and_an_autoscaler():
    assert not [obj for obj in _objects() if obj["kind"] == "StatefulSet" and obj["metadata"]["name"] ==
                "memory-service"]
    deployment = _find("Deployment", "memory-service")
    replicas = deployment["spec"]["replicas"]
    assert replicas > 1
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    budget = _find("PodDisruptionBudget", "memory-service")
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    assert "maxUnavailable" not in budget["spec"]
    assert 1 <= budget["spec"]["minAvailable"] < replicas  # a drain can evict one replica, and never the last

    autoscaler = _find("HorizontalPodAutoscaler", "memory-service")
    assert autoscaler["apiVersion"] == "autoscaling/v2"
    assert autoscaler["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                     "name": "memory-service"}
    assert autoscaler["spec"]["minReplicas"] == replicas
    assert autoscaler["spec"]["minReplicas"] > budget["spec"]["minAvailable"]
    assert autoscaler["spec"]["maxReplicas"] > autoscaler["spec"]["minReplicas"]
    (metric,) = autoscaler["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 100
    container = _container("Deployment", "memory-service")
    assert container["resources"]["requests"]["cpu"]  # utilization is measured against the request


def test_memory_service_pods_keep_only_caches_and_fit_them_in_their_memory_limit():
    pod = _find("Deployment", "memory-service")["spec"]["template"]["spec"]
    container = _container("Deployment", "memory-service")
    data_dir = _environment(container)["INFERSCALE_DATA_DIR"]
    data_volume = next(mount["name"] for mount in container["volumeMounts"] if mount["mountPath"] == data_dir)
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert "emptyDir" in volumes[data_volume]
    assert not [volume for volume in pod["volumes"] if "persistentVolumeClaim" in volume]
    settings = _find("ConfigMap", "memory-service-config")["data"]
    assert "INFERSCALE_KV_DISK_BUDGET_GB" not in settings  # the object store is the durable tier
    caches = (int(settings["INFERSCALE_KV_HOST_BUDGET_MB"]) + int(settings["INFERSCALE_SEARCH_CACHE_MB"])) << 20
    limit = _memory(container["resources"]["limits"]["memory"])
    assert _memory(container["resources"]["requests"]["memory"]) == limit
    assert caches <= 0.6 * limit  # room for Python, ONNX Runtime, LanceDB and gRPC buffers


def _selected_workload(service: dict) -> dict:
    """The one workload whose pods the Service selects."""
    (workload,) = [obj for obj in _objects() if obj["kind"] in WORKLOAD_KINDS and service["spec"]["selector"].items()
                   <= obj["spec"]["template"]["metadata"]["labels"].items()]
    return workload


def test_services_route_to_named_container_ports():
    services = [obj for obj in _objects() if obj["kind"] == "Service"]
    assert {service["metadata"]["name"] for service in services} >= {
        "memory-service", "memory-service-headless", "inference-node", "inference-router", "inference-router-by-load",
        *STORES}
    for service in services:
        workload = _selected_workload(service)
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        ports = _container_ports(container)
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)
            assert port["port"] == ports[port["targetPort"]], (service["metadata"]["name"], port)


def test_memory_service_address_in_the_model_config_resolves_to_every_replica():
    """Workers and nodes reach every replica through the headless Service's DNS name (gRPC's dns resolver, round
    robin); only ready replicas are in its answer."""
    headless = _find("Service", "memory-service-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert not headless["spec"].get("publishNotReadyAddresses", False)
    deployment = _find("Deployment", "memory-service")
    assert headless["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    grpc_port = _service_port("memory-service-headless", "grpc")
    assert grpc_port == _service_port("memory-service", "grpc")
    address = f"dns:///memory-service-headless.{NAMESPACE}.svc.cluster.local:{grpc_port}"
    data = _find("ConfigMap", "model-config")["data"]
    for name in ("INFERSCALE_WORKER_MEMORY_SERVICE", "INFERSCALE_NODE_MEMORY_SERVICE"):
        assert data[name] == address, name


def test_worker_and_node_agree_on_what_names_the_fact_kv():
    data = _find("ConfigMap", "model-config")["data"]
    for setting in ("MODEL", "KV_DTYPE", "CONTEXT_WINDOW"):
        assert data[f"INFERSCALE_WORKER_{setting}"] == data[f"INFERSCALE_NODE_{setting}"], setting


def test_precompute_worker_parser_accepts_the_manifest_and_requests_a_gpu(monkeypatch):
    container, parser = _parser_under_manifest_environment("Deployment", "precompute-worker",
                                                           ["python", "-m", "precompute_worker"],
                                                           "precompute_worker.__main__", monkeypatch)
    args = parser.parse_args(container.get("args", []))
    assert args.device == "cuda"
    assert any(Path(args.model).is_relative_to(mount["mountPath"]) for mount in container["volumeMounts"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def _vllm_server_parser():
    """The OpenAI server's own parser, from whichever module this vLLM release keeps it in."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for module in ("vllm.entrypoints.openai.cli_args", "vllm.entrypoints.launchers.cli_args"):
        if importlib.util.find_spec(module) is not None:
            return importlib.import_module(module).make_arg_parser(FlexibleArgumentParser())
    raise AssertionError("no make_arg_parser in this vLLM")


def test_inference_node_flags_are_ones_inference_node_or_vllm_accepts(monkeypatch):
    container, parser = _parser_under_manifest_environment("Deployment", "inference-node",
                                                           ["python3", "-m", "inference_node"],
                                                           "inference_node.__main__", monkeypatch)
    args, vllm_args = parser.parse_known_args(container["args"])
    assert any(Path(args.model).is_relative_to(mount["mountPath"]) for mount in container["volumeMounts"])
    vllm_parsed = _vllm_server_parser().parse_args(["--model", args.model, *vllm_args])
    assert vllm_parsed.port == _container_ports(container)["http"]
    assert vllm_parsed.host == "0.0.0.0"


def test_inference_node_probes_health_with_a_startup_allowance_for_model_load():
    container = _container("Deployment", "inference-node")
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # /health turns 503 while the node drains (inference_node/drain.py): liveness asks vLLM's /ping instead.
    assert container["livenessProbe"]["httpGet"] == {"path": "/ping", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    volumes = {volume["name"]: volume for volume in _find("Deployment", "inference-node")["spec"]["template"]["spec"]
               ["volumes"]}
    shm_mount = next(mount for mount in container["volumeMounts"] if mount["mountPath"] == "/dev/shm")
    assert volumes[shm_mount["name"]]["emptyDir"]["medium"] == "Memory"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_inference_nodes_run_as_a_fleet_behind_a_headless_service_and_drain_when_stopped():
    deployment = _find("Deployment", "inference-node")
    assert deployment["spec"]["replicas"] >= 2
    headless = _find("Service", "inference-node")
    assert headless["spec"]["clusterIP"] == "None"
    assert not headless["spec"].get("publishNotReadyAddresses", False)
    assert headless["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # Stopping: the preStop sleep lets the router drop the deleted pod, then vLLM finishes its requests in flight
    # (--shutdown-timeout; 0 would abort them) and tears the engine down, all before the kubelet's SIGKILL.
    container = _container("Deployment", "inference-node")
    args = container["args"]
    drain_s = int(args[args.index("--shutdown-timeout") + 1])
    sleep_command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep_command[0] == "sleep" and drain_s > 0
    grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s >= int(sleep_command[1]) + drain_s + 15  # the engine's teardown after the drain


def _router(name: str = "inference-router") -> tuple[dict, Any]:
    """A router's container and its flags as its own launcher parses them."""
    from vllm_router.launch_router import parse_router_args

    container = _container("Deployment", name)
    assert container["command"] == ["vllm-router"]
    return container, parse_router_args(container["args"])


def test_router_hashes_the_user_header_the_nodes_check_over_the_ready_nodes_it_finds_by_label():
    from harness.router import FAILOVER_FLAGS, USER_HEADER

    container, args = _router()
    assert args.policy == "consistent_hash"
    assert _environment(_container("Deployment", "inference-node"))["INFERSCALE_NODE_USER_HEADER"] == USER_HEADER
    assert args.service_discovery and args.service_discovery_namespace == NAMESPACE
    node_labels = _find("Deployment", "inference-node")["spec"]["template"]["metadata"]["labels"]
    router_labels = _find("Deployment", "inference-router")["spec"]["template"]["metadata"]["labels"]
    assert args.selector and all(node_labels.get(key) == value for key, value in args.selector.items())
    assert not all(router_labels.get(key) == value for key, value in args.selector.items())
    assert args.service_discovery_port == _container_ports(_container("Deployment", "inference-node"))["http"]
    given = container["args"]  # the failover the fleet tests exercise (tests/inference_node/test_fleet_routing.py)
    for flag, value in zip(FAILOVER_FLAGS[::2], FAILOVER_FLAGS[1::2], strict=True):
        assert given[given.index(flag) + 1] == value, flag
    ports = _container_ports(container)
    assert (args.host, args.port) == ("0.0.0.0", ports["http"])
    assert (args.prometheus_host, args.prometheus_port) == ("0.0.0.0", ports["metrics"])
    annotations = _find("Deployment", "inference-router")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.prometheus_port
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}


def test_requests_naming_no_user_have_a_router_of_their_own_balancing_the_same_nodes_by_load():
    """inference-router-by-load is inference-router but for its policy (power_of_two: the less busy node) and its pods'
    component: the same nodes, discovery, failover, ports, probes, image and service account; each router's Service
    reaches its own pods only, and both routers' pods are scraped under the one job inference-router."""
    by_user, by_user_args = _router()
    by_load, by_load_args = _router("inference-router-by-load")
    assert (by_user_args.policy, by_load_args.policy) == ("consistent_hash", "power_of_two")
    assert dataclasses.replace(by_load_args, policy=by_user_args.policy) == by_user_args
    assert {key: value for key, value in by_load.items() if key != "args"} == {
        key: value for key, value in by_user.items() if key != "args"}
    user_pods, load_pods = (_find("Deployment", name)["spec"]["template"]
                            for name in ("inference-router", "inference-router-by-load"))
    assert load_pods["spec"]["serviceAccountName"] == user_pods["spec"]["serviceAccountName"]
    assert load_pods["metadata"]["annotations"] == user_pods["metadata"]["annotations"]
    assert load_pods["metadata"]["labels"]["app.kubernetes.io/name"] == "inference-router" == user_pods["metadata"][
        "labels"]["app.kubernetes.io/name"]
    assert _find("Deployment", "inference-router-by-load")["spec"]["replicas"] >= 2
    for service_name in ("inference-router", "inference-router-by-load"):
        assert _selected_workload(_find("Service", service_name))["metadata"]["name"] == service_name


def _gateway_objects() -> list[dict]:
    return [doc for path in GATEWAY_MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _matching_rule(rules: list[dict], path: str, headers: dict[str, str]) -> dict:
    """The HTTPRoute rule a request matches: among the rules with a match the request satisfies, the one whose match
    has the most header matches, then the first (the Gateway API's precedence for one path prefix)."""
    def satisfied(match: dict) -> bool:
        if not path.startswith(match["path"]["value"]):
            return False
        for header in match.get("headers", []):
            value = {name.lower(): value for name, value in headers.items()}.get(header["name"].lower())
            if value is None or not (re.fullmatch(header["value"], value) if header["type"] == "RegularExpression"
                                     else value == header["value"]):
                return False
        return True

    candidates = [(len(match.get("headers", [])), -index, rule) for index, rule in enumerate(rules)
                  for match in rule["matches"] if satisfied(match)]
    assert candidates, (path, headers)
    return max(candidates, key=lambda candidate: candidate[:2])[2]


def test_gateway_route_sends_requests_naming_a_user_to_the_user_router_and_the_rest_to_the_load_router():
    """deploy/gateway's HTTPRoute, checked by its structure (kubernetes-validate knows no CRD): fields of the Gateway
    API's v1 schema, backends that are Services of deploy/k8s on their http port, and a request with a non-empty user
    header routed to the consistent-hash router, any other to the power_of_two one. Kept out of deploy/k8s, which
    applies on clusters without the Gateway API."""
    from harness.router import USER_HEADER

    assert GATEWAY_MANIFESTS and not [obj for obj in _objects() if obj["apiVersion"].startswith("gateway.")]
    (route,) = _gateway_objects()
    assert (route["apiVersion"], route["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    assert route["metadata"]["namespace"] == NAMESPACE
    spec = route["spec"]
    assert set(spec) <= HTTP_ROUTE_SPEC and spec["parentRefs"]
    assert all(set(reference) <= PARENT_REF and reference["name"] for reference in spec["parentRefs"])
    for rule in spec["rules"]:
        assert set(rule) <= HTTP_ROUTE_RULE
        for match in rule["matches"]:
            assert set(match) <= HTTP_ROUTE_MATCH and match["path"]["type"] in PATH_MATCH_TYPES
            for header in match.get("headers", []):
                assert set(header) <= HEADER_MATCH and header["type"] in HEADER_MATCH_TYPES
        (backend,) = rule["backendRefs"]
        assert set(backend) <= BACKEND_REF and backend.get("kind", "Service") == "Service"
        assert backend.get("group", "") == "" and backend.get("namespace", NAMESPACE) == NAMESPACE
        assert backend["port"] == _service_port(backend["name"], "http")

    def policy(headers: dict[str, str], path: str = "/v1/chat/completions") -> str:
        (backend,) = _matching_rule(spec["rules"], path, headers)["backendRefs"]
        return _router(_selected_workload(_find("Service", backend["name"]))["metadata"]["name"])[1].policy

    assert policy({USER_HEADER: "user-1"}) == policy({USER_HEADER.upper(): "u"}, "/v1/completions") == "consistent_hash"
    for headers in ({}, {USER_HEADER: ""}, {"x-request-id": "r-1"}, {"x-session-id": "s-1"}):
        assert policy(headers) == "power_of_two", headers


def test_router_may_watch_the_pods_of_its_namespace_and_nothing_else():
    account = _find("Deployment", "inference-router")["spec"]["template"]["spec"]["serviceAccountName"]
    _find("ServiceAccount", account)
    assert not [obj for obj in _objects() if obj["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (binding,) = [obj for obj in _objects() if obj["kind"] == "RoleBinding" and any(
        subject["kind"] == "ServiceAccount" and subject["name"] == account for subject in obj["subjects"])]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    role = _find(binding["roleRef"]["kind"], binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def test_router_image_ships_the_release_the_fleet_tests_run():
    import importlib.metadata

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = [requirement for requirement in extras["test"] if requirement.startswith("vllm-router")]
    version = pin.split("==")[1]
    assert importlib.metadata.version("vllm-router") == version
    assert f"pip install {pin}" in (REPO_ROOT / "deploy" / "docker" / "router.Dockerfile").read_text()
    assert _container("Deployment", "inference-router")["image"].endswith(f":{version}")


def test_every_pod_runs_as_non_root():
    workloads = [obj for obj in _objects() if obj["kind"] in WORKLOAD_KINDS]
    assert {obj["metadata"]["name"] for obj in workloads} >= set(STORES)
    for obj in workloads:
        name = obj["metadata"]["name"]
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"].get("runAsGroup", 1) != 0, name
        if obj["spec"].get("volumeClaimTemplates"):  # its volume writable for that user
            assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"], name
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context.get("runAsUser", 1) != 0 and context.get("runAsNonRoot", True) is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert "ALL" in context["capabilities"]["drop"], name


def test_dockerfiles_pass_hadolint():
    assert DOCKERFILES
    result = subprocess.run([_bin("hadolint"), *map(str, DOCKERFILES)], check=False, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfiles_copy_only_existing_paths_and_run_existing_programs_as_non_root():
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        for line in re.findall(r"^COPY (.+)$", text, flags=re.MULTILINE):
            *sources, _destination = line.split()
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"{dockerfile.name}: COPY {source}"
        for program in re.findall(r'"-m", "(\w+)"', text):
            assert (REPO_ROOT / program / "__main__.py").exists(), f"{dockerfile.name}: -m {program}"
        users = re.findall(r"^USER (\S+)$", text, flags=re.MULTILINE)
        assert users and not users[-1].startswith(("0", "root")), dockerfile.name


def test_dockerignore_keeps_every_copied_path_in_the_build_context():
    ignored = {line.strip().rstrip("/") for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for dockerfile in DOCKERFILES:
        for line in re.findall(r"^COPY (.+)$", dockerfile.read_text(), flags=re.MULTILINE):
            for source in line.split()[:-1]:
                assert source.rstrip("/") not in ignored, f"{dockerfile.name}: {source} is in .dockerignore"


def test_manifest_images_are_the_ones_the_dockerfiles_document_and_the_stores_are_pinned():
    tags = {tag for dockerfile in DOCKERFILES for tag in re.findall(r"-t (\S+) \.", dockerfile.read_text())}
    images = {obj["metadata"]["name"]: container["image"] for obj in _objects() if obj["kind"] in WORKLOAD_KINDS
              for container in obj["spec"]["template"]["spec"]["containers"]}
    assert {image for name, image in images.items() if name not in STORES} == tags
    for store in STORES:  # official images at a release, never a moving "latest"
        repository, _, tag = images[store].rpartition(":")
        assert repository and tag and tag != "latest" and "/" not in tag, images[store]


def test_kustomization_lists_every_manifest_and_kubectl_builds_it():
    kustomization = yaml.safe_load((REPO_ROOT / "deploy" / "kustomization.yaml").read_text())
    assert kustomization["resources"] == [f"k8s/{path.name}" for path in MANIFESTS]
    result = subprocess.run(["kubectl", "kustomize", str(REPO_ROOT / "deploy")], check=False, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert sorted((obj["kind"], obj["metadata"]["name"]) for obj in built) == sorted(
        (obj["kind"], obj["metadata"]["name"]) for obj in _objects())
