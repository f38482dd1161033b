"""`python -m inference_node`'s own flags and INFERSCALE_NODE_* variables: the published ones, with NodeSettings'
defaults their own; every other flag goes to vLLM."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

import inference_node.__main__ as node_main
from inference_node.__main__ import NodeOptions, build_parser
from inference_node.memory_request import MAX_MEMORY_TOKENS
from inference_node.settings import NodeSettings
from tests.inferscale_kv.published_flags import assert_each_flag_reads_its_variable, flag_defaults

# Every flag of the node's own and its default but --node-id's (the host name), as operators' manifests know them.
PUBLISHED_FLAGS = {
    "--memory-service": "127.0.0.1:50051", "--model": None, "--kv-dtype": "float32", "--context-window": 50,
    "--model-name": None, "--node-cache-mb": 0, "--host-tier-mb": None, "--kv-miss-policy": "auto",
    "--kv-durable-tier": "", "--warm-facts": 50,
    "--memory-top-k": 20, "--synchronous-loads": "auto",
    "--kv-crossover-tokens": "measured", "--recompute-tail-facts": 0, "--retrieve-timeout-s": 2.0,
    "--fetch-timeout-s": 10.0, "--load-stats-path": "", "--embed-queries-locally": False,
    "--embedding-model": "all-MiniLM-L6-v2", "--user-header": "", "--user-token-header": "", "--dry-run": False,
}


def test_the_flags_and_their_defaults_are_the_published_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = flag_defaults(build_parser, monkeypatch)
    assert flags.pop("--node-id") == socket.gethostname()
    assert flags == PUBLISHED_FLAGS


def test_every_flag_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_each_flag_reads_its_variable(build_parser, monkeypatch, samples={
        "--kv-dtype": "bfloat16", "--synchronous-loads": "off", "--node-id": "node-7", "--kv-crossover-tokens": "120",
        "--kv-miss-policy": "best-effort", "--host-tier-mb": ("64", 64)})


def test_node_settings_take_their_defaults_from_the_flags_declaration(monkeypatch: pytest.MonkeyPatch) -> None:
    flag_defaults(build_parser, monkeypatch)  # clears the environment
    parser = build_parser()
    parsed, vllm_args = parser.parse_known_args(["--max-model-len", "64", "--dtype", "half"])
    settings = parser.build(NodeSettings, parsed, memory_service="m", node_id="n", model_dir="d")
    assert settings == NodeSettings(memory_service="m", node_id="n", model_dir="d")
    assert (settings.node_cache_mb, settings.default_top_k, settings.retrieve_timeout_s, settings.fetch_timeout_s,
            settings.recompute_tail_facts) == (0, 20, 2.0, 10.0, 0)
    assert vllm_args == ["--max-model-len", "64", "--dtype", "half"]


def test_flags_and_variables_reach_the_node_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSCALE_NODE_MEMORY_TOP_K", "7")
    monkeypatch.setenv("INFERSCALE_NODE_EMBED_QUERIES_LOCALLY", "true")
    parser = build_parser()
    parsed, vllm_args = parser.parse_known_args(["--node-cache-mb", "8", "--kv-dtype", "bfloat16", "--port", "8000",
                                                 "--user-header", "x-user"])
    assert parser.build(NodeOptions, parsed).kv_dtype == "bfloat16"
    settings = parser.build(NodeSettings, parsed, memory_service="m", node_id="n", model_dir="d")
    assert (settings.default_top_k, settings.embed_queries_locally, settings.node_cache_mb, settings.user_header) == (
        7, True, 8, "x-user")
    assert NodeSettings.from_mapping(json.loads(settings.to_json())) == settings
    assert vllm_args == ["--port", "8000"]


def test_a_bad_variable_is_a_usage_error_naming_the_flag_and_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("INFERSCALE_NODE_FETCH_TIMEOUT_S", "soon")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_known_args([])
    assert exit_info.value.code == 2
    assert "argument --fetch-timeout-s: INFERSCALE_NODE_FETCH_TIMEOUT_S: 'soon' is not a number" in \
        capsys.readouterr().err


def test_help_lists_every_flag_with_its_variable() -> None:
    result = subprocess.run([sys.executable, "-m", "inference_node", "--help"], capture_output=True, text=True,
                            check=True)
    text = " ".join(result.stdout.split())
    for flag in [*PUBLISHED_FLAGS, "--node-id"]:
        assert f"{flag} " in text and f"(INFERSCALE_NODE_{flag[2:].replace('-', '_').upper()}" in text, flag


def test_dry_run_prints_vllms_command_with_the_settings_and_starts_nothing(
        tiny_llama_dir, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(node_main, "cuda_device_bytes", lambda: None)
    monkeypatch.setattr(node_main.os, "execvpe", lambda *_: pytest.fail("--dry-run started vLLM"))
    monkeypatch.setenv("INFERSCALE_NODE_NODE_CACHE_MB", "64")
    node_main.main(["--model", str(tiny_llama_dir), "--memory-top-k", "5", "--kv-crossover-tokens", "0",
                    "--max-model-len", "128", "--dry-run"])
    command = capsys.readouterr().out
    assert "vllm.entrypoints.openai.api_server" in command and "--max-model-len 128" in command
    assert '"node_cache_mb": 64' in command and '"default_top_k": 5' in command


@pytest.mark.parametrize(("given", "read"), [("measured", "measured"), ("-1", "measured"), ("0", "0"), ("120", "120")])
def test_the_crossover_flag_is_measured_or_a_number_of_tokens(given: str, read: str) -> None:
    """-1, the flag's spelling of measured before it had a name, still reads as measured."""
    parser = build_parser()
    assert parser.build(NodeOptions, parser.parse_known_args(["--kv-crossover-tokens", given])[0]) \
        .kv_crossover_tokens == read


def test_the_settings_hold_the_crossover_in_tokens(tiny_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """What requests default to (memory.kv_crossover_tokens): the flag's number, or the measured crossover (none is
    measured for the tiny model: 0)."""
    monkeypatch.setattr(node_main, "cuda_device_bytes", lambda: None)
    assert node_main.plan_launch(["--model", str(tiny_llama_dir)]).settings.kv_crossover_tokens == 0
    launch = node_main.plan_launch(["--model", str(tiny_llama_dir), "--kv-crossover-tokens", "120"])
    assert launch.settings.kv_crossover_tokens == 120


def test_a_crossover_that_is_no_number_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_known_args(["--kv-crossover-tokens", "soon"])
    error = capsys.readouterr().err
    assert "argument --kv-crossover-tokens: 'soon' is neither measured nor a number of tokens" in error


def test_a_crossover_past_what_a_request_may_give_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Regression (issue 40 review): a larger flag was accepted as every request's default, which parse_memory then
    refused, so every memory request without its own kv_crossover_tokens was answered 400 for the node's setting."""
    with pytest.raises(SystemExit):
        build_parser().parse_known_args(["--kv-crossover-tokens", str(MAX_MEMORY_TOKENS + 1)])
    assert f"more than {MAX_MEMORY_TOKENS} tokens" in capsys.readouterr().err
    parser = build_parser()
    assert parser.build(NodeOptions, parser.parse_known_args(
        ["--kv-crossover-tokens", str(MAX_MEMORY_TOKENS)])[0]).kv_crossover_tokens == str(MAX_MEMORY_TOKENS)


def test_a_negative_recomputed_tail_is_refused_naming_the_flag(tiny_llama_dir) -> None:
    with pytest.raises(SystemExit, match="--recompute-tail-facts must be 0 or more"):
        node_main.plan_launch(["--model", str(tiny_llama_dir), "--recompute-tail-facts", "-1"])


@pytest.mark.parametrize(("location", "why"), [("absent", "is not a directory"),
                                               ("gs://bucket/kv", "neither a directory nor s3://")])
def test_a_durable_tier_the_node_cannot_read_is_refused_naming_the_flag(tiny_llama_dir, tmp_path, location,
                                                                        why) -> None:
    location = str(tmp_path / location) if location == "absent" else location
    with pytest.raises(SystemExit, match=f"--kv-durable-tier: .*{why}"):
        node_main.plan_launch(["--model", str(tiny_llama_dir), "--kv-durable-tier", location])


@pytest.mark.parametrize(("flags", "why"), [
    (["--kv-durable-tier", "s3://bucket/kv"], "--kv-durable-tier reads every user's KV"),
    (["--enable-log-requests"], "--enable-log-requests logs"),
])
def test_user_tokens_are_refused_beside_what_would_bypass_or_log_them(tiny_llama_dir, flags, why) -> None:
    with pytest.raises(SystemExit, match=why):
        node_main.plan_launch(["--model", str(tiny_llama_dir), "--user-token-header", "x-inferscale-user-token",
                               *flags])


def test_a_missing_model_folder_is_refused_naming_the_flag(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--model: .* is not a local model folder"):
        node_main.plan_launch(["--model", str(tmp_path / "absent")])


def test_a_vllm_flag_that_begins_like_one_of_the_nodes_goes_to_vllm() -> None:
    """Regression: argparse took `--host` for an abbreviation of the node's `--host-tier-mb`."""
    parsed, vllm_args = build_parser().parse_known_args(["--host", "0.0.0.0", "--port", "8000"])
    assert vllm_args == ["--host", "0.0.0.0", "--port", "8000"] and parsed.host_tier_mb is None


def test_the_tiers_default_sizes_follow_the_device_the_host_and_the_ranks(tmp_path) -> None:
    gib = 1 << 30
    # An 80 GiB GPU at 0.85 with 16 GiB of weights: a quarter of the 52 GiB left.
    assert node_main.default_node_cache_mb(80 * gib, 0.85, 16 * gib) == int(0.25 * (0.85 * 80 - 16) * 1024)
    assert node_main.default_node_cache_mb(80 * gib, 0.2, 16 * gib) == node_main.MIN_NODE_CACHE_MB
    assert node_main.default_node_cache_mb(None, 0.9, 0) == node_main.CPU_NODE_CACHE_MB
    # A quarter of the host, shared by the ranks (review of issue 41: each rank pinned the whole quarter), at most
    # 64 GiB in all; none on a CPU node, whose device tier is host memory already.
    assert node_main.default_host_tier_mb(128 * gib, 80 * gib, 1) == 32 * 1024
    assert node_main.default_host_tier_mb(128 * gib, 80 * gib, 4) == 8 * 1024
    assert node_main.default_host_tier_mb(560 * gib, 80 * gib, 8) == 8 * 1024
    assert node_main.default_host_tier_mb(128 * gib, None, 1) == 0
    (tmp_path / "model.safetensors").write_bytes(b"w" * 100)
    (tmp_path / "pytorch_model.bin").write_bytes(b"w" * 100)  # the same weights again: not counted twice
    (tmp_path / "training_args.bin").write_bytes(b"t" * 7)
    assert node_main.weights_bytes(tmp_path) == 100
    (tmp_path / "model.safetensors").unlink()
    assert node_main.weights_bytes(tmp_path) == 100


@pytest.mark.parametrize("flags", [[], ["--chat-template", "t.jinja"], ["--chat_template=t.jinja"],
                                   ["--chat-template-content-format", "openai"],
                                   ["--default-chat-template-kwargs", "{}"], ["--tokenizer", "other"]])
def test_chat_memory_goes_as_token_ids_unless_vllms_flags_change_how_it_renders_chat(tiny_llama_dir, flags) -> None:
    launch = node_main.plan_launch(["--model", str(tiny_llama_dir), *flags])
    assert launch.settings.chat_token_ids is not bool(flags)


@pytest.mark.parametrize(("architectures", "files", "flags", "expected"), [
    (["LlamaForCausalLM"], [], [], True),
    (["LlamaForCausalLM"], [], ["--tokenizer-mo", "slow"], False),  # abbreviated, as vLLM's parser takes it
    (["LlamaForCausalLM"], [], ["--config", "serve.yaml"], False),
    (["LlamaForCausalLM"], [], ["--hf-overrides", "{}"], False),
    (["LlamaForCausalLM"], [], ["--max-model-len", "128", "--tokenizer-pool-size", "2"], True),
    (["GptOssForCausalLM"], [], [], False),
    (["DeepseekV32ForCausalLM"], [], [], False),
    ([], [], [], False),
    (["LlamaForCausalLM"], ["preprocessor_config.json"], [], False),
    (["MistralForCausalLM"], ["tekken.json"], [], False),
])
def test_vllm_renders_chat_with_the_tokenizer_only_for_plain_architectures_folders_and_flags(
        tmp_path, architectures, files, flags, expected) -> None:
    for name in files:
        (tmp_path / name).write_text("{}")
    config = SimpleNamespace(architectures=architectures)
    assert node_main.vllm_renders_chat_with_the_tokenizer(tmp_path, config, flags) is expected


def test_the_longest_prompt_is_the_larger_of_the_flag_and_the_models_scaled_positions() -> None:
    config = SimpleNamespace(max_position_embeddings=4096, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert node_main.longest_prompt_tokens(config, []) == 16384
    assert node_main.longest_prompt_tokens(config, ["--max-model-len", "32768"]) == 32768
    unscaled = SimpleNamespace(max_position_embeddings=2048)
    assert node_main.longest_prompt_tokens(unscaled, ["--max-model-len=1k"]) == 2048  # not a number: the positions
