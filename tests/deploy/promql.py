"""Just enough PromQL lexing for the monitoring tests: the series selectors an expression names, an alert expression
with its thresholds lifted, and Grafana's interval variables replaced by durations Prometheus accepts."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Words followed by a parenthesized list of label names, not of expressions.
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
# Keywords, and the grouping modifiers where written without a label list (`on (instance) group_left`).
_KEYWORDS = {"and", "or", "unless", "bool", "inf", "nan", "group_left", "group_right"}
_COMPARISONS = {"==", "!=", ">", "<", ">=", "<="}

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')
  | (?P<braces>\{(?:"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|[^}"'])*\})
  | (?P<range>\[[^\]]*\])
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|>=|<=|[-+*/%^<>(),])
""", re.VERBOSE)
_MATCHER = re.compile(r"""\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')\s*,?""")

GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "5m", "$__interval": "15s"}


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[Matcher, ...]


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    start: int
    end: int


def _tokens(expr: str) -> list[_Token]:
    tokens, position = [], 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None or match.lastgroup is None:
            raise ValueError(f"cannot lex {expr[position:position + 30]!r} in {expr!r}")
        if match.lastgroup != "space":
            tokens.append(_Token(match.lastgroup, match.group(), match.start(), match.end()))
        position = match.end()
    return tokens


def _matchers(braces: str) -> tuple[Matcher, ...]:
    inner, matchers, position = braces[1:-1], [], 0
    while inner[position:].strip():
        match = _MATCHER.match(inner, position)
        if match is None:
            raise ValueError(f"cannot read the matchers {braces!r}")
        matchers.append(Matcher(match.group(1), match.group(2), match.group(3)[1:-1]))
        position = match.end()
    return tuple(matchers)


def _skip_parentheses(tokens: list[_Token], index: int) -> int:
    """The index after the parenthesized group opening at `index`."""
    depth = 0
    for position in range(index, len(tokens)):
        depth += {"(": 1, ")": -1}.get(tokens[position].text, 0)
        if depth == 0:
            return position + 1
    raise ValueError("unbalanced parentheses")


def selectors(expr: str) -> list[Selector]:
    """Every series selector in `expr`: metric names with their label matchers (functions, aggregations, keywords
    and grouping labels left out)."""
    tokens, found, index = _tokens(expr), [], 0
    while index < len(tokens):
        token = tokens[index]
        following = tokens[index + 1] if index + 1 < len(tokens) else None
        if token.kind == "ident" and token.text.lower() == "offset":
            raise ValueError("offset is not supported here")
        if token.kind == "ident" and token.text in _GROUPING and following is not None and following.text == "(":
            index = _skip_parentheses(tokens, index + 1)
            continue
        called = following is not None and (following.text == "(" or following.text in _GROUPING)
        if token.kind == "ident" and not called and token.text.lower() not in _KEYWORDS:
            has_matchers = following is not None and following.kind == "braces"
            found.append(Selector(token.text, _matchers(following.text) if has_matchers and following else ()))
            index += 2 if has_matchers else 1
            continue
        if token.kind == "braces":
            raise ValueError(f"a selector without a metric name: {token.text}")
        index += 1
    return found


def without_thresholds(expr: str) -> str:
    """`expr` with every comparison against a number (`> 0.05`, `== 0`) replaced by `> -Inf`: the alert's signal,
    which returns every series the alert watches whether or not it would fire."""
    tokens, pieces, last = _tokens(expr), [], 0
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token.kind == "op" and token.text in _COMPARISONS and index + 1 < len(tokens):
            operand = index + 1
            if tokens[operand].text == "-" and operand + 1 < len(tokens):
                operand += 1
            if tokens[operand].kind == "number":
                pieces += [expr[last:token.start], "> -Inf"]
                last = tokens[operand].end
                index = operand + 1
                continue
        index += 1
    return "".join([*pieces, expr[last:]])


def with_grafana_variables(expr: str) -> str:
    """`expr` with Grafana's interval variables replaced by fixed durations."""
    for variable, duration in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, duration)
    if "$" in expr:
        raise ValueError(f"an unknown Grafana variable in {expr!r}")
    return expr
