"""deploy/: the Kubernetes manifests validate offline, and every port, probe, flag and environment name in them is
one the programs accept; the Dockerfiles lint clean and name only paths and programs that exist."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import yaml

from inferscale_kv.call_credentials import NODE_TOKEN_ENV, WORKER_TOKEN_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO_ROOT / "deploy" / "k8s").glob("*.yaml"))
DOCKERFILES = sorted((REPO_ROOT / "deploy" / "docker").glob("*.Dockerfile"))
KUBERNETES_VERSION = "1.31.0"
NAMESPACE = "inferscale"


def _objects() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _find(kind: str, name: str) -> dict:
    matches = [obj for obj in _objects() if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def _container(kind: str, name: str) -> dict:
    (container,) = _find(kind, name)["spec"]["template"]["spec"]["containers"]
    return container


def _environment(container: dict) -> dict[str, str]:
    """The container's environment as the program sees it: its ConfigMaps, then its own literal values."""
    environment: dict[str, str] = {}
    for source in container.get("envFrom", []):
        environment.update(_find("ConfigMap", source["configMapRef"]["name"])["data"])
    for entry in container.get("env", []):
        environment[entry["name"]] = entry.get("value", "from-the-downward-api")
    return environment


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


def test_memory_service_config_loader_accepts_the_manifest_and_serves_on_its_ports(monkeypatch):
    from memory_service import config as service_config

    container, _ = _parser_under_manifest_environment("StatefulSet", "memory-service",
                                                      ["python", "-m", "memory_service"], "memory_service.config",
                                                      monkeypatch)
    loaded = service_config.load_config(container.get("args", []))
    loaded.validate()
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    commented = dict(re.findall(r"# (INFERSCALE_\w+): (\S+)", (REPO_ROOT / "deploy/k8s/10-config.yaml").read_text()))
    assert set(commented) == {"INFERSCALE_AUTH_FILE", "INFERSCALE_TLS_CERT_FILE", "INFERSCALE_TLS_KEY_FILE",
                              "INFERSCALE_TLS_CLIENT_CA_FILE"}
    for variable, path in commented.items():  # each commented-out setting names a flag and a path in a mount
        assert Path(path).parent.as_posix() in mounts, variable
    assert _unknown_prefixed_variables(commented, service_config.ENV_PREFIX, service_config.build_parser()) == []
    ports = _container_ports(container)
    assert ports == {"grpc": loaded.port, "metrics": loaded.metrics_port, "health": loaded.health_port}
    assert str(loaded.data_dir) in mounts
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # plaintext, whether or not the API is TLS
        assert container[probe]["grpc"]["port"] == loaded.health_port, probe
    from memory_service.server import SERVICE_NAME

    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    annotations = _find("StatefulSet", "memory-service")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == loaded.metrics_port


def test_services_route_to_named_container_ports():
    workloads = {obj["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]: obj
                 for obj in _objects() if obj["kind"] in ("StatefulSet", "Deployment")}
    services = [obj for obj in _objects() if obj["kind"] == "Service"]
    assert {service["metadata"]["name"] for service in services} >= {"memory-service", "inference-node"}
    for service in services:
        workload = workloads[service["spec"]["selector"]["app.kubernetes.io/name"]]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        ports = _container_ports(container)
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)
            assert port["port"] == ports[port["targetPort"]], (service["metadata"]["name"], port)


def test_memory_service_address_in_the_model_config_is_its_service():
    service = _find("Service", "memory-service")
    grpc_port = next(port["port"] for port in service["spec"]["ports"] if port["name"] == "grpc")
    data = _find("ConfigMap", "model-config")["data"]
    for name in ("INFERSCALE_WORKER_MEMORY_SERVICE", "INFERSCALE_NODE_MEMORY_SERVICE"):
        assert data[name] == f"memory-service:{grpc_port}", name


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
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    volumes = {volume["name"]: volume for volume in _find("Deployment", "inference-node")["spec"]["template"]["spec"]
               ["volumes"]}
    shm_mount = next(mount for mount in container["volumeMounts"] if mount["mountPath"] == "/dev/shm")
    assert volumes[shm_mount["name"]]["emptyDir"]["medium"] == "Memory"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_every_pod_runs_as_non_root():
    for obj in _objects():
        if obj["kind"] in ("StatefulSet", "Deployment"):
            pod = obj["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
            assert pod["securityContext"]["runAsUser"] != 0, obj["metadata"]["name"]


def test_memory_service_has_a_disruption_budget_and_its_own_volume():
    budget = _find("PodDisruptionBudget", "memory-service")
    statefulset = _find("StatefulSet", "memory-service")
    assert budget["spec"]["selector"] == statefulset["spec"]["selector"]
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] in {mount["name"] for mount in _container("StatefulSet", "memory-service")
                                         ["volumeMounts"]}


def test_dockerfiles_pass_hadolint():
    assert DOCKERFILES
    result = subprocess.run([_bin("hadolint"), *map(str, DOCKERFILES)], check=False, capture_output=True, text=True, timeout=120)
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


def test_manifest_images_are_the_ones_the_dockerfiles_document():
    tags = {tag for dockerfile in DOCKERFILES for tag in re.findall(r"-t (\S+) \.", dockerfile.read_text())}
    images = {container["image"] for obj in _objects() if obj["kind"] in ("StatefulSet", "Deployment")
              for container in obj["spec"]["template"]["spec"]["containers"]}
    assert images == tags


def test_kustomization_lists_every_manifest_and_kubectl_builds_it():
    kustomization = yaml.safe_load((REPO_ROOT / "deploy" / "kustomization.yaml").read_text())
    assert kustomization["resources"] == [f"k8s/{path.name}" for path in MANIFESTS]
    result = subprocess.run(["kubectl", "kustomize", str(REPO_ROOT / "deploy")], check=False, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert sorted((obj["kind"], obj["metadata"]["name"]) for obj in built) == sorted(
        (obj["kind"], obj["metadata"]["name"]) for obj in _objects())
