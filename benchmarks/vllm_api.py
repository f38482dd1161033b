"""Which vLLM releases InferScale's connector can run on: the parts of vLLM it uses, read from each release's wheel
and compared with a reference release (--reference).

    python -m benchmarks.vllm_api WHEEL [WHEEL ...]      # wheels from `pip download --no-deps vllm==X`

For each wheel: the signature of every KVConnectorBase_V1 hook the connector implements or calls, the fields of
KVConnectorOutput and KVConnectorStats it reads, the attention backends' `do_kv_cache_update`, and the forward
context's `no_compile_layers`. Prints a markdown matrix: "=" where the release matches the reference, else what
differs. Reads the sources only (no import), so it runs anywhere.
"""

from __future__ import annotations

import argparse
import ast
import re
import zipfile
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
METRICS = "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"
OUTPUTS = "vllm/v1/outputs.py"
FORWARD_CONTEXT = "vllm/forward_context.py"
FLASH_ATTN = "vllm/v1/attention/backends/flash_attn.py"
# The hooks of inference_node/connector/ (implemented or called).
HOOKS = ("__init__", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "build_kv_connector_stats", "build_prom_metrics",
         "get_kv_connector_stats", "register_kv_caches", "start_load_kv", "get_finished",
         "get_block_ids_with_load_errors", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "shutdown",
         "_get_connector_metadata")
OUTPUT_FIELDS = ("finished_recving", "invalid_block_ids", "failed_recving")


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


def read_api(wheel: Path) -> dict[str, str]:
    """The API points InferScale depends on, as text to compare."""
    with zipfile.ZipFile(wheel) as archive:
        def text(name: str) -> str:
            return archive.read(name).decode() if name in archive.namelist() else ""

        base, outputs = text(BASE), text(OUTPUTS)
        hooks = _signatures(base, "KVConnectorBase_V1")
        api = {f"KVConnectorBase_V1.{hook}": hooks.get(hook, "missing") for hook in HOOKS}
        fields = _class_fields(outputs, "KVConnectorOutput")
        api |= {f"KVConnectorOutput.{field}": "present" if field in fields else "missing" for field in OUTPUT_FIELDS}
        api["KVConnectorStats (metrics.py)"] = "present" if "class KVConnectorStats" in text(METRICS) else "missing"
        api["KVConnectorPromMetrics (metrics.py)"] = ("present" if "class KVConnectorPromMetrics" in text(METRICS)
                                                      else "missing")
        api["ForwardContext.no_compile_layers"] = ("present" if "no_compile_layers" in text(FORWARD_CONTEXT)
                                                   else "missing")
        api["flash_attn do_kv_cache_update"] = ("present" if re.search(r"def do_kv_cache_update", text(FLASH_ATTN))
                                                else "missing")
    return api


def version_of(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheels", type=Path, nargs="+")
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
