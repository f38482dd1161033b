"""`inferscale`: the memory service from a shell, on top of MemoryClient.

    inferscale facts add USER [TEXT ...] [--file FACTS.jsonl]   facts as arguments, or a JSON Lines / JSON file
    inferscale facts list USER | facts search USER QUERY | facts delete USER FACT_ID ...
    inferscale users delete USER
    inferscale turns add USER --file TURNS.jsonl
    inferscale stats [USER] | inferscale health

A file holds one fact per line (a string, or an object of FactInput's fields: fact_id, text, source_turn_id,
timestamp, metadata), or one JSON array of them; turns likewise (turn_id, seq, session_id, speaker, text, timestamp).
Tables, or JSON with --json. Every flag also comes from a variable, which --help names (--memory-service:
INFERSCALE_MEMORY_SERVICE, --token: INFERSCALE_MEMORY_SERVICE_TOKEN, --top-k: INFERSCALE_TOP_K, facts add --file:
INFERSCALE_FACTS_FILE, ...); a flag given wins. Exit status 1 when the service refuses a call or a file cannot be
read (the reason on standard error), 2 for a wrong command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from inferscale_client.client import MemoryClient
from inferscale_client.errors import InferScaleError
from inferscale_client.requests import RETRIEVAL_MODES
from inferscale_client.settings import ENV, ENV_PREFIX, ClientSettings

Run = Callable[[MemoryClient, argparse.Namespace], Any]


def _add(parser: argparse.ArgumentParser, flag: str, variable: str = "", **kwargs: Any) -> None:
    """A flag whose default comes from its variable (INFERSCALE_<FLAG> unless named) when that is set."""
    variable = variable or ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
    if variable in os.environ:
        raw = os.environ[variable]
        if "choices" in kwargs and raw not in kwargs["choices"]:
            raise SystemExit(f"inferscale: {variable}: one of {', '.join(map(repr, kwargs['choices']))}, not {raw!r}")
        kwargs["default"] = raw.lower() in ("1", "true", "yes") if kwargs.get("action") == "store_true" else raw
    kwargs["help"] = f"{kwargs.get('help', '')} (env {variable})".strip()
    parser.add_argument(flag, **kwargs)


def _records(path: Path) -> Iterator[Any]:
    """The items of a JSON array file, or of a JSON Lines file (one per non-empty line)."""
    text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        yield from json.loads(text)
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                yield json.loads(line)
            except ValueError as error:
                raise SystemExit(f"inferscale: {path}:{number}: not JSON ({error})") from None


def _progress(total: int, unit: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    """A progress bar on standard error (tqdm, installed with the `cli` extra) and its closer; none without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return (lambda _: None), (lambda: None)
    bar = tqdm(total=total, unit=unit, file=sys.stderr, disable=total < 2)
    return bar.update, bar.close


def _facts_add(client: MemoryClient, args: argparse.Namespace) -> Any:
    facts: list[Any] = list(args.text)
    if args.file:
        facts += list(_records(args.file))
    if not facts:
        raise SystemExit("inferscale: facts add: give facts as arguments or --file")
    update, close = _progress(len(facts), "fact")
    try:
        return client.add_facts(args.user, facts, batch_size=args.batch_size, progress=update)
    finally:
        close()


def _turns_add(client: MemoryClient, args: argparse.Namespace) -> Any:
    turns = list(_records(args.file))
    update, close = _progress(len(turns), "turn")
    try:
        return {"turns_written": client.add_turns(args.user, turns, progress=update)}
    finally:
        close()


def _plain(value: Any) -> Any:
    if isinstance(value, Message):
        return MessageToDict(value, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _table(rows: list[dict], columns: Sequence[str]) -> str:
    cells = [[str(row.get(column, "")) for column in columns] for row in rows]
    widths = [max([len(column), *(len(line[index]) for line in cells)]) for index, column in enumerate(columns)]
    lines = ["  ".join(column.ljust(width) for column, width in zip(columns, widths, strict=True))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(line.rstrip() for line in lines)


def _render(value: Any) -> str:
    """A result as a table (a list of facts or outcomes) or as key: value lines."""
    plain = _plain(value)
    if isinstance(plain, list):
        rows = [{**row.pop("fact", {}), **row} for row in plain]  # a search hit: its fact's fields, then rank, score
        columns = [c for c in ("rank", "score", "fact_id", "version", "outcome", "text") if any(c in r for r in rows)]
        return _table(rows, columns)
    if isinstance(plain, dict):
        return "\n".join(f"{key}: {json.dumps(item) if isinstance(item, (dict, list)) else item}"
                         for key, item in plain.items())
    return str(plain)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferscale", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add(parser, "--memory-service", ENV["memory_service"], help="the service's address (every replica: dns:///host:port)")
    _add(parser, "--token", ENV["token"], help="bearer token")
    _add(parser, "--tls-ca-file", ENV["tls_ca_file"], help="CA of the service's certificate (TLS on)")
    _add(parser, "--tls-cert-file", ENV["tls_cert_file"], help="client certificate (mutual TLS; TLS on)")
    _add(parser, "--tls-key-file", ENV["tls_key_file"], help="the client certificate's key")
    _add(parser, "--timeout-s", ENV["timeout_s"], type=float, help="each call's deadline")
    _add(parser, "--json", action="store_true", help="print JSON instead of tables")
    groups = parser.add_subparsers(dest="group", required=True)

    def command(group: argparse._SubParsersAction, name: str, run: Run, help: str) -> argparse.ArgumentParser:
        sub = group.add_parser(name, help=help)
        sub.set_defaults(run=run)
        sub.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
        return sub

    facts = groups.add_parser("facts", help="a user's facts").add_subparsers(dest="command", required=True)
    add = command(facts, "add", _facts_add, "store facts (arguments, or --file JSON / JSON Lines)")
    add.add_argument("user")
    add.add_argument("text", nargs="*", help="facts' texts")
    _add(add, "--file", "INFERSCALE_FACTS_FILE", type=Path, help="JSON Lines or JSON array of facts (-: stdin)")
    _add(add, "--batch-size", type=int, default=1000, help="most facts per call")
    listing = command(facts, "list", lambda c, a: list(c.list_facts(a.user, page_size=a.page_size)), "list facts")
    listing.add_argument("user")
    _add(listing, "--page-size", type=int, default=0, help="facts per call (0: the service's default)")
    search = command(facts, "search", lambda c, a: c.search(a.user, a.query, top_k=a.top_k, retrieval=a.retrieval),
                     "the facts best matching a query")
    search.add_argument("user")
    search.add_argument("query")
    _add(search, "--top-k", type=int, default=0, help="facts to return (0: the service's default)")
    _add(search, "--retrieval", default="", choices=sorted(RETRIEVAL_MODES), help="vector, keyword or hybrid")
    delete = command(facts, "delete", lambda c, a: c.delete_facts(a.user, a.fact_ids), "delete facts by id")
    delete.add_argument("user")
    delete.add_argument("fact_ids", nargs="+")
    users = groups.add_parser("users", help="users").add_subparsers(dest="command", required=True)
    command(users, "delete", lambda c, a: c.delete_user(a.user), "delete everything of a user").add_argument("user")
    turns = groups.add_parser("turns", help="a user's conversation turns").add_subparsers(dest="command",
                                                                                         required=True)
    turns_add = command(turns, "add", _turns_add, "store turns from --file (JSON Lines or JSON array)")
    turns_add.add_argument("user")
    _add(turns_add, "--file", "INFERSCALE_TURNS_FILE", type=Path, required="INFERSCALE_TURNS_FILE" not in os.environ,
         help="the turns (-: stdin)")
    stats = groups.add_parser("stats", help="the service's figures (a tenant's token: one of its users)")
    stats.set_defaults(run=lambda c, a: c.stats(a.user))
    stats.add_argument("user", nargs="?", default="")
    groups.add_parser("health", help="SERVING once the service is ready").set_defaults(
        run=lambda c, a: {"status": c.health()})
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = ClientSettings.from_env(memory_service=args.memory_service, token=args.token,
                                       tls_ca_file=args.tls_ca_file, tls_cert_file=args.tls_cert_file,
                                       tls_key_file=args.tls_key_file, timeout_s=args.timeout_s)
    try:
        with MemoryClient(settings) as client:
            result = args.run(client, args)
    except InferScaleError as error:
        print(f"inferscale: {error}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TypeError) as error:  # a file that cannot be read, or a fact or turn not as described
        print(f"inferscale: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(_plain(result), indent=2) if args.json else _render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
