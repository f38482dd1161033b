"""inferscale_kv.options: each option declared once on a dataclass field gives a flag and an environment variable."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from inferscale_kv.options import OptionError, OptionParser, option

PREFIX = "TEST_OPTIONS_"


@dataclass(frozen=True)
class Inner:
    """Limits of the test program."""

    max_items: int = option(10, help="most items")


@dataclass(frozen=True)
class Example:
    count: int = option(3, help="how many")
    ratio: float = option(0.5, help="a share (50%)")
    name: str = option("plain", help="a name")
    verbose: bool = option(False, help="say more")
    mode: str = option("fast", choices=("fast", "slow"), help="how")
    cache_dir: Path | None = option(None, help="where the cache lives")
    label: str | None = option(None, help="an optional label")
    top_k: int = option(20, flag="memory-top-k", help="facts per request")
    host_name: str = option(default_factory=lambda: "made-by-factory", help="from a factory")
    level: str = option("info", parse=str.lower, help="a level in any case")
    inner: Inner = field(default_factory=Inner)
    computed: str = "not an option"


@dataclass(frozen=True)
class Required:
    data_dir: Path = option(help="where the data lives")


def parse(argv: list[str], cls: type = Example) -> object:
    parser = OptionParser(PREFIX, prog="test")
    parser.add_options(cls)
    return parser.build(cls, parser.parse_args(argv))


def test_declared_defaults_without_flags_or_environment() -> None:
    assert parse([]) == Example()
    assert Example().host_name == "made-by-factory"


def test_the_environment_supplies_defaults_typed_by_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_OPTIONS_COUNT", "7")
    monkeypatch.setenv("TEST_OPTIONS_RATIO", "0.25")
    monkeypatch.setenv("TEST_OPTIONS_NAME", "from-env")
    monkeypatch.setenv("TEST_OPTIONS_MODE", "slow")
    monkeypatch.setenv("TEST_OPTIONS_MAX_ITEMS", "99")
    monkeypatch.setenv("TEST_OPTIONS_HOST_NAME", "h1")
    monkeypatch.setenv("TEST_OPTIONS_LEVEL", "DEBUG")
    parsed = parse([])
    assert parsed == Example(count=7, ratio=0.25, name="from-env", mode="slow", inner=Inner(max_items=99),
                             host_name="h1", level="debug")


def test_a_flag_beats_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_OPTIONS_COUNT", "7")
    monkeypatch.setenv("TEST_OPTIONS_MAX_ITEMS", "99")
    parsed = parse(["--count", "8", "--max-items", "100"])
    assert parsed == Example(count=8, inner=Inner(max_items=100))


def test_a_bad_environment_value_replaced_by_a_flag_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_OPTIONS_COUNT", "many")
    assert parse(["--count", "8"]) == Example(count=8)


@pytest.mark.parametrize(("text", "on"), [("1", True), ("true", True), ("YES", True), ("True", True),
                                          ("0", False), ("false", False), ("no", False), ("", False)])
def test_a_switch_reads_its_variable_as_a_boolean(monkeypatch: pytest.MonkeyPatch, text: str, on: bool) -> None:
    monkeypatch.setenv("TEST_OPTIONS_VERBOSE", text)
    assert parse([]) == Example(verbose=on)
    assert parse(["--verbose"]) == Example(verbose=True)


def test_a_switch_takes_no_value() -> None:
    assert parse(["--verbose"]) == Example(verbose=True)
    with pytest.raises(SystemExit):
        parse(["--verbose", "yes"])


@pytest.mark.parametrize(("variable", "text", "flag", "reason"), [
    ("TEST_OPTIONS_COUNT", "many", "--count", "'many' is not an integer"),
    ("TEST_OPTIONS_RATIO", "half", "--ratio", "'half' is not a number"),
    ("TEST_OPTIONS_VERBOSE", "maybe", "--verbose", "'maybe' is not one of 1, true, yes, 0, false, no"),
    ("TEST_OPTIONS_MODE", "medium", "--mode", "'medium' is not one of fast, slow"),
    ("TEST_OPTIONS_MAX_ITEMS", "1e3", "--max-items", "'1e3' is not an integer"),
])
def test_a_bad_environment_value_is_a_usage_error_naming_the_flag_and_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, text: str, flag: str,
        reason: str) -> None:
    monkeypatch.setenv(variable, text)
    with pytest.raises(SystemExit) as exit_info:
        parse([])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {variable}: {reason}" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--count", "many"], "argument --count: 'many' is not an integer"),
    (["--mode", "medium"], "argument --mode: 'medium' is not one of fast, slow"),
    (["--memory-top-k", "x"], "argument --memory-top-k: 'x' is not an integer"),
])
def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                           message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_choices_admit_each_declared_value() -> None:
    assert parse(["--mode", "slow"]) == Example(mode="slow")


def test_optional_paths_and_strings_are_none_when_unset_or_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse([]) == Example(cache_dir=None, label=None)
    assert parse(["--cache-dir", "/tmp/c", "--label", "l"]) == Example(cache_dir=Path("/tmp/c"), label="l")
    assert parse(["--cache-dir", ""]) == Example(cache_dir=None)
    monkeypatch.setenv("TEST_OPTIONS_CACHE_DIR", "/tmp/from-env")
    assert parse([]) == Example(cache_dir=Path("/tmp/from-env"))
    monkeypatch.setenv("TEST_OPTIONS_CACHE_DIR", "")
    monkeypatch.setenv("TEST_OPTIONS_LABEL", "")
    assert parse([]) == Example(cache_dir=None, label=None)


def test_a_flag_named_apart_from_its_field_names_its_variable_and_destination(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = OptionParser(PREFIX)
    parser.add_options(Example)
    assert parser.parse_args(["--memory-top-k", "5"]).memory_top_k == 5
    monkeypatch.setenv("TEST_OPTIONS_MEMORY_TOP_K", "6")
    assert parse([]) == Example(top_k=6)


def test_a_required_option_given_neither_flag_nor_variable_is_an_option_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OptionError, match=r"--data-dir: required \(or set TEST_OPTIONS_DATA_DIR\)"):
        parse([], Required)
    assert parse(["--data-dir", "/tmp/d"], Required) == Required(Path("/tmp/d"))
    monkeypatch.setenv("TEST_OPTIONS_DATA_DIR", "/tmp/e")
    assert parse([], Required) == Required(Path("/tmp/e"))


def test_build_takes_the_other_fields_values_and_keeps_their_defaults_otherwise() -> None:
    parser = OptionParser(PREFIX)
    parser.add_options(Example)
    parsed = parser.parse_args(["--count", "4"])
    assert parser.build(Example, parsed, computed="given") == Example(count=4, computed="given")
    assert parser.build(Example, parsed, count=5).count == 5  # a value given beats the flag's


def test_unknown_flags_are_left_for_another_program() -> None:
    parser = OptionParser(PREFIX)
    parser.add_options(Example)
    parsed, rest = parser.parse_known_args(["--count", "4", "--other", "x"])
    assert parser.build(Example, parsed) == Example(count=4)
    assert rest == ["--other", "x"]


def test_help_lists_each_flag_with_its_help_variable_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_OPTIONS_COUNT", "7")
    parser = OptionParser(PREFIX, prog="test")
    parser.add_options(Example, title="example")
    text = " ".join(parser.format_help().split())
    assert "--count COUNT how many (TEST_OPTIONS_COUNT=7; default: 3)" in text
    assert "a share (50%) (TEST_OPTIONS_RATIO; default: 0.5)" in text
    assert "--verbose say more (TEST_OPTIONS_VERBOSE; default: off)" in text
    assert "--mode {fast,slow} how (TEST_OPTIONS_MODE; default: fast)" in text
    assert "where the cache lives (TEST_OPTIONS_CACHE_DIR; default: unset)" in text
    assert "--memory-top-k MEMORY_TOP_K facts per request (TEST_OPTIONS_MEMORY_TOP_K; default: 20)" in text
    assert "inner: Limits of the test program. --max-items MAX_ITEMS most items" in text
    assert "--computed" not in text


def test_an_option_of_a_type_without_a_conversion_is_refused_when_declared() -> None:
    @dataclass(frozen=True)
    class Listed:
        items: list[str] = option(default_factory=list, help="not a scalar")

    with pytest.raises(TypeError, match="an option's type"):
        OptionParser(PREFIX).add_options(Listed)


def test_two_options_with_one_flag_are_refused() -> None:
    @dataclass(frozen=True)
    class Twice:
        count: int = option(1, help="one")
        other: int = option(2, flag="count", help="two")

    with pytest.raises(argparse.ArgumentError, match="--count"):
        OptionParser(PREFIX).add_options(Twice)
