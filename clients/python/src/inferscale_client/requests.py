"""What the clients send, whatever they send it with: facts and turns as request messages split under the service's
limits, and the values the calls take turned into messages. Shared by the synchronous and the asyncio client."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeAlias, TypeVar

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from inferscale.v1 import memory_pb2 as pb
from inferscale_client.errors import InferScaleError
from inferscale_client.settings import MAX_CALL_BYTES

FactLike: TypeAlias = "str | Mapping[str, Any] | pb.FactInput"
TurnLike: TypeAlias = "Mapping[str, Any] | pb.Turn"
RETRIEVAL_MODES = {"": pb.RETRIEVAL_MODE_UNSPECIFIED, "vector": pb.RETRIEVAL_MODE_VECTOR,
                   "keyword": pb.RETRIEVAL_MODE_KEYWORD, "hybrid": pb.RETRIEVAL_MODE_HYBRID}
Item = TypeVar("Item", pb.FactInput, pb.Turn)
_PER_CALL_LIMIT = re.compile(r"entries exceeds the limit of (\d+) per call")


def _timestamp(value: Any) -> Timestamp:
    stamp = Timestamp()
    if isinstance(value, datetime):
        stamp.FromDatetime(value)
    elif isinstance(value, str):
        stamp.FromJsonString(value)
    elif isinstance(value, Timestamp):
        stamp.CopyFrom(value)
    else:
        raise TypeError(f"timestamp: a datetime, an RFC 3339 string or a Timestamp, not {type(value).__name__}")
    return stamp


def fact_input(fact: FactLike) -> pb.FactInput:
    """A fact as the service takes it: its text, or a mapping of FactInput's fields (fact_id, text, source_turn_id,
    timestamp, metadata)."""
    if isinstance(fact, pb.FactInput):
        return fact
    if isinstance(fact, str):
        return pb.FactInput(text=fact)
    fields = dict(fact)
    if "timestamp" in fields:
        fields["timestamp"] = _timestamp(fields["timestamp"])
    return pb.FactInput(**fields)


def turn(value: TurnLike) -> pb.Turn:
    """A conversation turn: a mapping of Turn's fields (turn_id, seq, session_id, speaker, text, timestamp)."""
    if isinstance(value, pb.Turn):
        return value
    fields = dict(value)
    if "timestamp" in fields:
        fields["timestamp"] = _timestamp(fields["timestamp"])
    return pb.Turn(**fields)


def batches(items: Iterable[Item], max_items: int, max_bytes: int = MAX_CALL_BYTES) -> Iterator[list[Item]]:
    """`items` in calls of at most `max_items`, each under `max_bytes` (an item alone past it goes alone: the service
    names it when it refuses it)."""
    batch: list[Item] = []
    size = 0
    for item in items:
        item_size = item.ByteSize() + 8
        if batch and (len(batch) >= max_items or size + item_size > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item_size
    if batch:
        yield batch


class FactIngest:
    """The calls of one add_facts: `next_batch` until None; each batch `answered` or `refused`. A batch refused as more
    facts than the service takes per call (its limit below the client's) is sent again, it and every later batch
    split at the service's limit; any other refusal (a quota, a bad fact) is raised, nothing of that batch stored."""

    def __init__(self, facts: Iterable[FactLike], batch_size: int, progress: Callable[[int], None] | None) -> None:
        self._pending = list(batches((fact_input(fact) for fact in facts), batch_size))
        self._progress = progress
        self.results: list[pb.IngestedFact] = []

    def next_batch(self) -> list[pb.FactInput] | None:
        return self._pending.pop(0) if self._pending else None

    def answered(self, batch: list[pb.FactInput], response: pb.IngestFactsResponse) -> None:
        self.results.extend(response.facts)
        if self._progress is not None:
            self._progress(len(batch))

    def refused(self, batch: list[pb.FactInput], error: InferScaleError) -> None:
        limit = per_call_limit(error, "facts")
        if limit is None or not 0 < limit < len(batch):
            raise error
        rest = [fact for pending in self._pending for fact in pending]
        self._pending = list(batches([*batch, *rest], limit))


def per_call_limit(error: InferScaleError, field: str) -> int | None:
    """The service's per-call limit on `field` when `error` is its refusal of a call holding more (memory_service's
    "<field>: N entries exceeds the limit of L per call"); None for any other error."""
    if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED or error.field != field:
        return None
    found = _PER_CALL_LIMIT.search(error.details)
    return int(found.group(1)) if found else None


def chunks(values: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for start in range(0, len(values), size):
        yield values[start:start + size]
