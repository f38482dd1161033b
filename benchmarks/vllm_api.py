"""Which vLLM releases InferScale's connector can run on: the parts of vLLM it uses, read from each release's wheel
(or an installed vLLM: its site-packages folder) and compared with a reference release (--reference).

    python -m benchmarks.vllm_api WHEEL_OR_SITE_PACKAGES [...]      # wheels from `pip download --no-deps vllm==X`

For each release: the signature of every KVConnectorBase_V1 hook the connector implements or calls, the fields of
KVConnectorOutput it reads, the worker-to-scheduler metadata (KVConnectorWorkerMetadata.aggregate, summed over
ranks by the output aggregator), the scheduler's handling of a None answer (the request is skipped and asked
again) and of kv_load_failure_policy="fail" (the request finished with an error), the connector's metadata in steps
without a forward (both model runners), the connector stats and Prometheus classes, the attention backends'
`do_kv_cache_update`, and the forward context's `no_compile_layers`. Prints a markdown matrix: "=" where the
release matches the reference, else what differs. Reads the sources only (no import), so it runs anywhere.
"""

from __future__ import annotations

import argparse
import ast
import re
import zipfile
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
METRICS = "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"
AGGREGATOR = "vllm/distributed/kv_transfer/kv_connector/utils.py"
OUTPUTS = "vllm/v1/outputs.py"
SCHEDULER = "vllm/v1/core/sched/scheduler.py"
TRANSFER_CONFIG = "vllm/config/kv_transfer.py"
RUNNER_MIXIN = "vllm/v1/worker/kv_connector_model_runner_mixin.py"
RUNNER_V2_CONNECTOR = "vllm/v1/worker/gpu/kv_connector.py"
FORWARD_CONTEXT = "vllm/forward_context.py"
FLASH_ATTN = "vllm/v1/attention/backends/flash_attn.py"
VERSION = "vllm/_version.py"
# The hooks of inference_node/connector/ (implemented or called).
HOOKS = ("__init__", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "build_kv_connector_stats", "build_prom_metrics",
         "get_kv_connector_stats", "start_load_kv", "build_connector_worker_meta", "get_block_ids_with_load_errors",
         "wait_for_layer_load", "save_kv_layer", "wait_for_save", "shutdown", "_get_connector_metadata")
OUTPUT_FIELDS = ("invalid_block_ids", "kv_connector_worker_meta")
# Behaviours read from the source: (what, file, a pattern that is there when the release behaves so).
BEHAVIOURS = (
    ("scheduler skips a request answered None", SCHEDULER, r"if ext_tokens is None:"),
    ('kv_load_failure_policy "fail"', TRANSFER_CONFIG, r'kv_load_failure_policy: Literal\[[^]]*"fail"'),
    ("failed loads finished with an error under it", SCHEDULER,
     r"failed_kv_load_req_ids and not self\.recompute_kv_load_failures"),
    ("worker metadata summed over ranks", AGGREGATOR, r"kv_connector_worker_meta\.aggregate\(|"
                                                      r"aggregated_kv_connector_worker_meta\.aggregate\("),
    ("metadata in steps without a forward (V1 runner)", RUNNER_MIXIN, r"def kv_connector_no_forward"),
    ("metadata in steps without a forward (V2 runner)", RUNNER_V2_CONNECTOR, r"def no_forward"),
)


def _signatures(source: str, class_name: str) -> dict[str, str]:
    """method name -> its parameters (names, in order) of `class_name` in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {item.name: ", ".join([a.arg for a in item.args.args]
                                         + ([f"*{item.args.vararg.arg}"] if item.args.vararg else [])
                                         + [a.arg for a in item.args.kwonlyargs]
                                         + ([f"**{item.args.kwarg.arg}"] if item.args.kwarg else []))
                    for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)}
    return {}


def _class_fields(source: str, class_name: str) -> set[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {item.target.id for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return set()


def _reader(source: Path):
    """A function from a path inside the vllm package's tree to its text ("" if absent), for a wheel or a
    site-packages folder."""
    if source.is_dir():
        return lambda name: (source / name).read_text() if (source / name).exists() else ""
    archive = zipfile.ZipFile(source)
    names = set(archive.namelist())
    return lambda name: archive.read(name).decode() if name in names else ""


def read_api(source: Path) -> dict[str, str]:
    """The API points InferScale depends on, as text to compare."""
    text = _reader(source)
    base, outputs = text(BASE), text(OUTPUTS)
    hooks = _signatures(base, "KVConnectorBase_V1")
    api = {f"KVConnectorBase_V1.{hook}": hooks.get(hook, "missing") for hook in HOOKS}
    api["KVConnectorWorkerMetadata.aggregate"] = _signatures(base, "KVConnectorWorkerMetadata").get("aggregate",
                                                                                                     "missing")
    fields = _class_fields(outputs, "KVConnectorOutput")
    api |= {f"KVConnectorOutput.{field}": "present" if field in fields else "missing" for field in OUTPUT_FIELDS}
    api |= {what: ("present" if re.search(pattern, text(path)) else "missing") if text(path) else f"no {path}"
            for what, path, pattern in BEHAVIOURS}
    api["KVConnectorStats (metrics.py)"] = "present" if "class KVConnectorStats" in text(METRICS) else "missing"
    api["KVConnectorPromMetrics (metrics.py)"] = ("present" if "class KVConnectorPromMetrics" in text(METRICS)
                                                  else "missing")
    api["ForwardContext.no_compile_layers"] = "present" if "no_compile_layers" in text(FORWARD_CONTEXT) else "missing"
    api["flash_attn do_kv_cache_update"] = ("present" if re.search(r"def do_kv_cache_update", text(FLASH_ATTN))
                                            else "missing")
    return api


def version_of(source: Path) -> str:
    if source.is_dir():
        match = re.search(r"__version__ = version = '([^']+)'", _reader(source)(VERSION))
        return match.group(1) if match else source.name
    return source.name.split("-")[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheels", type=Path, nargs="+", help="vLLM wheels, or site-packages folders holding vllm/")
    parser.add_argument("--reference", default="0.26.0", help="the release the others are compared with")
    args = parser.parse_args()
    apis = {version_of(wheel): read_api(wheel) for wheel in sorted(args.wheels, key=lambda w: version_of(w))}
    versions = sorted(apis, key=lambda v: tuple(int(p) for p in re.findall(r"\d+", v)))
    reference = apis[args.reference]
    print("| API point | " + " | ".join(versions) + " |")
    print("|---|" + "---|" * len(versions))
    for point, value in reference.items():
        cells = ["=" if apis[v].get(point) == value else f"`{apis[v].get(point)}`" for v in versions]
        cells[versions.index(args.reference)] = f"`{value}`" if len(value) < 40 else "(reference)"
        print(f"| {point} | " + " | ".join(cells) + " |")
    matching = [v for v in versions if apis[v] == reference]
    print(f"\nreleases whose API matches {args.reference}: {', '.join(matching)}")


if __name__ == "__main__":
    main()
