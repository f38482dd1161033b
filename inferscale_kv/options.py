"""Options declared once, on dataclass fields; one parser gives each its flag and its environment variable.

    @dataclass(frozen=True)
    class WorkerOptions:
        max_facts: int = option(64, help="facts per lease")
        encoding: str = option("shared", choices=("shared", "naive"), help="...")
        model: str | None = option(None, help="local HF model folder")

    parser = OptionParser("INFERSCALE_WORKER_", prog="python -m precompute_worker")
    parser.add_options(WorkerOptions)
    options = parser.build(WorkerOptions, parser.parse_args(argv))

A field `max_facts` is the flag `--max-facts` (or `--<flag>` where the option names one) and the variable
`INFERSCALE_WORKER_MAX_FACTS` (the prefix, then the flag's name in upper snake case); the flag beats the variable, the
variable beats the declared default. The field's type is the option's: str, int, float, Path, bool (a switch: the flag
takes no value, the variable reads 1/true/yes or 0/false/no), or one of them or None (an empty value is None). A field
whose type is a dataclass is a group: its options are flags of their own (`limits: Limits` gives `--max-top-k`). A
field without `option()` is no flag: `build` takes its value as an argument, or the field's default.

A value a flag or a variable cannot take is a usage error naming the flag (and the variable), as argparse reports a
bad flag; an option without a default, given neither, is an OptionError from `build`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

T = TypeVar("T")

_METADATA_KEY = "inferscale_kv.option"
_SCALARS: tuple[type, ...] = (str, int, float, bool, Path)
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no", "")
_NOUNS = {int: "an integer", float: "a number", bool: "one of 1, true, yes, 0, false, no"}


class OptionError(ValueError):
    """An option was given no value and has no default; the message names its flag and variable."""


@dataclass(frozen=True)
class OptionSpec:
    """What a field's `option()` declares besides its default."""

    help: str
    choices: tuple[object, ...] | None = None
    flag: str | None = None  # the flag's name without "--", where it is not the field's name
    parse: Callable[[str], object] | None = None  # text to value, where the field's type does not say how


@overload
def option(default: T, *, help: str, choices: Sequence[object] | None = None, flag: str | None = None,
           parse: Callable[[str], object] | None = None) -> T: ...
@overload
def option(*, default_factory: Callable[[], T], help: str, choices: Sequence[object] | None = None,
           flag: str | None = None, parse: Callable[[str], object] | None = None) -> T: ...
@overload
def option(*, help: str, choices: Sequence[object] | None = None, flag: str | None = None,
           parse: Callable[[str], object] | None = None) -> Any: ...
def option(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, help: str,
           choices: Sequence[object] | None = None, flag: str | None = None,
           parse: Callable[[str], object] | None = None) -> Any:
    """A dataclass field that is an option: its default (none: the option is required), its help, and where needed
    the values it may take, its flag's name and how its text becomes a value."""
    spec = OptionSpec(help, tuple(choices) if choices is not None else None, flag, parse)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_METADATA_KEY: spec})


@dataclass(frozen=True)
class _Option:
    """One field's flag, variable and conversion."""

    flag: str
    variable: str
    kind: type
    optional: bool  # the type admits None
    spec: OptionSpec
    default: object  # dataclasses.MISSING: required

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def read(self, text: str) -> object:
        """The value of a flag's or variable's text; ValueError with the reason when it has none."""
        if self.optional and text == "":
            return None
        if self.spec.parse is not None:
            value = self.spec.parse(text)
        elif self.kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(f"{text!r} is not {_NOUNS[bool]}")
            value = text.lower() in _TRUE
        else:
            try:
                value = self.kind(text)
            except ValueError:
                raise ValueError(f"{text!r} is not {_NOUNS[self.kind]}") from None
        if self.spec.choices is not None and value not in self.spec.choices:
            raise ValueError(f"{text!r} is not one of {', '.join(map(str, self.spec.choices))}")
        return value


class _FromEnvironment(str):
    """A default read from an environment variable. argparse converts a text default with the flag's type once no
    flag replaced it; the conversion then names the variable where it fails."""

    variable: str

    def __new__(cls, text: str, variable: str) -> _FromEnvironment:
        default = super().__new__(cls, text)
        default.variable = variable
        return default


class _Switch(argparse.Action):
    """A flag without a value that turns its option on (argparse's store_true, with a type for its default's text)."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: object = None,
                 type: Callable[[str], object] | None = None, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, type=type, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True)


def _fields(cls: type) -> tuple[tuple[dataclasses.Field[Any], Any], ...]:
    """Each field of a dataclass with its annotation, resolved."""
    hints = typing.get_type_hints(cls)
    return tuple((field, hints[field.name]) for field in dataclasses.fields(cls))


def _scalar(hint: object) -> tuple[type, bool]:
    """The option type of an annotation, and whether it admits None."""
    arguments = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kinds = [argument for argument in arguments if argument is not type(None)]
    if len(kinds) != 1 or kinds[0] not in _SCALARS:
        raise TypeError(f"an option's type is one of str, int, float, bool, Path (or one of them or None), not {hint}")
    return kinds[0], len(kinds) < len(arguments)


def _is_group(field: dataclasses.Field[Any], hint: object) -> bool:
    return _METADATA_KEY not in field.metadata and isinstance(hint, type) and dataclasses.is_dataclass(hint)


class OptionParser(argparse.ArgumentParser):
    """An argparse parser whose flags come from option dataclasses, each with its environment variable as default."""

    def __init__(self, env_prefix: str, **kwargs: Any) -> None:
        kwargs.setdefault("usage", "%(prog)s [flags]")
        # Flags are spelled whole: with parse_known_args an abbreviation would take a flag meant for another program
        # (vLLM's --host read as the node's --host-tier-mb).
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)
        self.env_prefix = env_prefix
        self._declared: dict[tuple[type, str], _Option] = {}  # by dataclass and field

    def add_options(self, cls: type, title: str | None = None) -> None:
        """Adds a flag for every option of the dataclass `cls` and of its groups; --help lists them under `title`
        where given, a group's under its field's name and docstring."""
        self._add_options(cls, self.add_argument_group(title) if title else self)

    def _add_options(self, cls: type, container: argparse._ActionsContainer) -> None:
        for field, hint in _fields(cls):
            if _is_group(field, hint):
                assert isinstance(hint, type)
                self._add_options(hint, self.add_argument_group(field.name, _written_docstring(hint)))
            elif _METADATA_KEY in field.metadata:
                option = self._option(field, hint)
                self._add(container, option)
                self._declared[(cls, field.name)] = option

    def _option(self, field: dataclasses.Field[Any], hint: object) -> _Option:
        spec: OptionSpec = field.metadata[_METADATA_KEY]
        kind, optional = _scalar(hint)
        flag = "--" + (spec.flag or field.name.replace("_", "-"))
        variable = self.env_prefix + flag[2:].replace("-", "_").upper()
        if field.default is not dataclasses.MISSING:
            default: object = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = dataclasses.MISSING
        return _Option(flag, variable, kind, optional, spec, default)

    def _add(self, container: argparse._ActionsContainer, option: _Option) -> None:
        text = os.environ.get(option.variable)
        default = _FromEnvironment(text, option.variable) if text is not None else (
            None if option.default is dataclasses.MISSING else option.default)
        declared = "required" if option.default is dataclasses.MISSING else _shown(option.default)
        current = "" if text is None else f"={text}"
        help_text = f"{option.spec.help} ({option.variable}{current}; default: {declared})".replace("%", "%%")

        def value_of(given: str) -> object:
            try:
                return option.read(given)
            except ValueError as exc:
                source = f"{given.variable}: " if isinstance(given, _FromEnvironment) else ""
                raise argparse.ArgumentTypeError(f"{source}{exc}") from None

        if option.kind is bool:
            container.add_argument(option.flag, dest=option.dest, action=_Switch, type=value_of, default=default,
                                   help=help_text)
        else:
            metavar = "{" + ",".join(map(str, option.spec.choices)) + "}" if option.spec.choices else None
            container.add_argument(option.flag, dest=option.dest, type=value_of, default=default, metavar=metavar,
                                   help=help_text)

    def build(self, cls: type[T], parsed: argparse.Namespace, **values: object) -> T:
        """An instance of the dataclass `cls` from parsed flags: its options' and groups' values, then `values` for
        its other fields (a field neither gives keeps its default). OptionError names a required option not given."""
        arguments = dict(values)
        for field, hint in _fields(cls):
            if field.name in values:
                continue
            if _is_group(field, hint):
                assert isinstance(hint, type)
                arguments[field.name] = self.build(hint, parsed)
            elif _METADATA_KEY in field.metadata:
                option = self._declared[(cls, field.name)]
                value = getattr(parsed, option.dest)
                if value is None and option.default is dataclasses.MISSING:
                    raise OptionError(f"{option.flag}: required (or set {option.variable})")
                arguments[field.name] = value
        return cls(**arguments)


def _written_docstring(cls: type) -> str | None:
    """The class's docstring, unless it is the signature dataclasses writes for a class without one."""
    doc = cls.__doc__
    return None if doc is None or doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())


def _shown(value: object) -> str:
    """A default as --help writes it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) or "empty"
