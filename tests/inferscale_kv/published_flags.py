"""Checks of a program's published command line: its flags with their defaults, and each flag's variable."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from inferscale_kv.options import OptionParser


def flag_defaults(build_parser: Callable[[], OptionParser], monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Each flag with the value it parses to when neither it nor its variable is given."""
    prefix = build_parser().env_prefix
    for variable in list(os.environ):
        if variable.startswith(prefix):
            monkeypatch.delenv(variable)
    parser = build_parser()
    parsed = vars(parser.parse_known_args([])[0])
    return {action.option_strings[0]: parsed[action.dest] for action in parser._actions if action.dest != "help"}


def assert_each_flag_reads_its_variable(build_parser: Callable[[], OptionParser], monkeypatch: pytest.MonkeyPatch,
                                        samples: dict[str, str | tuple[str, object]]) -> None:
    """Sets each flag's variable (the prefix, then the flag's name in upper snake case) to another value than the
    default (`samples` for flags with choices or no default: the text, or the text and the value it reads as) and
    checks that the flag takes it."""
    for flag, default in flag_defaults(build_parser, monkeypatch).items():
        variable = build_parser().env_prefix + flag[2:].replace("-", "_").upper()
        expected: object
        if flag in samples:
            sample = samples[flag]
            text, expected = sample if isinstance(sample, tuple) else (sample, sample)
        elif isinstance(default, bool):
            text, expected = "true", True
        elif isinstance(default, int | float):
            text, expected = str(default + 1), default + 1
        else:
            text, expected = "/tmp/sample", "/tmp/sample"
        monkeypatch.setenv(variable, text)
        value = getattr(build_parser().parse_known_args([])[0], flag[2:].replace("-", "_"))
        assert (str(value) if isinstance(value, Path) else value) == expected, (flag, variable)
        monkeypatch.delenv(variable)
