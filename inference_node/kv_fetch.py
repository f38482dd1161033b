"""The node's byte path: fact KV from the memory service into host tensors, this rank's heads only. Free of vLLM:
it runs in the node's fetch process (inference_node.fetch_process), out of vLLM's engine process.

`MemoryServiceKv` reads a prefetch's chunks from the memory service's durable tier where the node is given it
(durable_blobs.py), and fetches the others over a few concurrent streaming `FetchKv` calls (each on a connection of
its own), each chunk asked for by its full key (content id included); each blob is checked (checksum, key, token ids)
and decoded on the host as it arrives, in native code. Under tensor parallelism each rank keeps only its KV heads; the
blob over the wire holds every head.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from inference_node.durable_blobs import DurableBlobs
from inference_node.plan import ChunkLoad
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.blob import CorruptKvBlob, decode_kv_heads
from inferscale_kv.call_credentials import NODE, memory_service_channel
from inferscale_kv.kv_key import KvKey

# Concurrent FetchKv calls per fetch, each on a connection of its own: one HTTP/2 connection is read by one thread of
# gRPC's and tops out near 1.5 GB/s. On a host of few cores the extra streams only cost CPU (2 cores: 0.61 GB/s on
# four against 0.64 on one; benchmarks/RESULTS.md, "The byte path"), so they are used from 8 cores up.
FETCH_STREAMS = 4 if (os.cpu_count() or 1) >= 8 else 1
logger = logging.getLogger(__name__)
# Durable-tier reads in flight per fetch process: on 2 cores, 1.4 GB/s on one thread and 2.2 on two (benchmarks/
# RESULTS.md, "Straight from the durable tier").
DURABLE_READERS = min(8, max(2, os.cpu_count() or 1))
FETCH_KV_METHOD = "/inferscale.v1.MemoryService/FetchKv"
FETCH_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.use_local_subchannel_pool", 1),  # a connection per channel, not one shared by equal channels
)
_BLOB_FIELD = 3  # FetchKvResponse.blob


def fetch_reply_blob(reply: bytes) -> memoryview:
    """The `blob` field of a serialized FetchKvResponse, as a view into `reply` (no copy): parsing the message would
    copy its megabytes twice. Walks the protobuf wire format (the last occurrence wins, as in protobuf); empty when
    the field is absent; CorruptKvBlob when the bytes are not a well-formed message."""
    view = memoryview(reply)
    blob = view[:0]
    position, end = 0, len(view)

    def varint() -> int:
        nonlocal position
        value = shift = 0
        while True:
            if position >= end or shift > 63:
                raise CorruptKvBlob("a FetchKv reply that is not a well-formed message")
            byte = view[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while position < end:
        tag = varint()
        field, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            varint()
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        elif wire_type == 2:
            length = varint()
            if field == _BLOB_FIELD:
                blob = view[position: position + length]
            position += length
        else:
            raise CorruptKvBlob(f"a FetchKv reply with wire type {wire_type}")
        if position > end:
            raise CorruptKvBlob("a FetchKv reply cut short")
    return blob


@dataclass(frozen=True)
class CachedKv:
    keys: torch.Tensor  # [layers, tokens, kv_heads, head_dim], pre-RoPE, on the node's device
    values: torch.Tensor
    token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape or self.keys.shape[1] != len(self.token_ids):
            raise ValueError(f"KV of shape {tuple(self.keys.shape)} / {tuple(self.values.shape)} for "
                             f"{len(self.token_ids)} token ids")

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2


class MemoryServiceKv:
    """Fetches over `streams` concurrent FetchKv calls, each on a channel (a TCP connection) of its own, the chunks
    split between them in order; each reply's bytes are checked and decoded as they arrive, on the call's thread, by
    native code (checksum read in place, one copy of this rank's heads into the tensor returned): nothing per byte in
    Python, and a blob never parsed into a protobuf message (`fetch_reply_blob`)."""

    def __init__(self, address: str, timeout_s: float, heads: slice, streams: int = FETCH_STREAMS,
                 pin_memory: bool | None = None, durable: DurableBlobs | None = None) -> None:
        """`durable`: the memory service's durable tier, read first (durable_blobs.py); FetchKv then brings only
        what it lacks."""
        self.address = address
        self.durable = durable
        self.durable_reads = 0  # chunks read from the durable tier so far
        self.timeout_s = timeout_s
        self.streams = max(1, streams)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._heads = heads
        self._fetches: list[Callable[..., Any]] = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._reader_pool: ThreadPoolExecutor | None = None

    def fetch(self, user_id: str, chunks: Sequence[ChunkLoad], dtype: torch.dtype,
              into: Sequence[torch.Tensor] | None = None, timeout_s: float | None = None, *,
              user_token: str = "") -> list[CachedKv]:
        """Every chunk's KV (this rank's heads) in host memory in `dtype`, contiguous, in chunk order, within
        `timeout_s` (else the source's); raises (LookupError, CorruptKvBlob, grpc.RpcError, ...) if any chunk
        cannot be had, ValueError if a key is named twice. With `into` (one contiguous [2, layers, tokens, heads,
        head_dim] buffer per chunk, in chunk order), each chunk's keys and values are decoded into its buffer (the
        fetch process's shared arena). Thread-safe."""
        if not chunks:
            return []
        if len({chunk.key for chunk in chunks}) != len(chunks):
            raise ValueError("a fetch names a chunk twice")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        buffers = dict(zip((chunk.key for chunk in chunks), into, strict=True)) if into is not None else {}
        deadline = time.monotonic() + timeout_s
        fetched = self._read_durable(chunks, dtype, buffers) if self.durable else {}
        rest = [chunk for chunk in chunks if chunk.key not in fetched]
        if rest:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"the durable tier's reads took the fetch's {timeout_s:.1f} s")
            fetched.update(self._fetch_streams(user_id, user_token, rest, dtype, buffers, left_s))
        return [fetched[chunk.key] for chunk in chunks]

    def _read_durable(self, chunks: Sequence[ChunkLoad], dtype: torch.dtype,
                      buffers: dict[KvKey, torch.Tensor]) -> dict[KvKey, CachedKv]:
        """The chunks the durable tier holds, read several at once, each checked and decoded like a FetchKv reply,
        once every read has ended (none writes into `buffers` after this returns). A chunk whose read fails, or
        whose blob fails its checks, is left to FetchKv, whose service checks its own copy (and queues a corrupt one
        again). A read that hangs holds the fetch past its deadline (the fetch process is then killed,
        fetch_process.py)."""
        assert self.durable is not None
        durable = self.durable

        def read(chunk: ChunkLoad) -> CachedKv | None:
            try:
                blob = durable.read(chunk.key)
                return None if blob is None else self._decoded(chunk, blob, dtype, buffers.get(chunk.key))
            except Exception as error:  # the service is asked instead
                logger.warning("InferScale: %s not read from the durable tier (%r); asking the memory service",
                               chunk.key, error)
                return None

        futures = [self._readers().submit(read, chunk) for chunk in chunks]
        wait(futures)
        read_here = {chunk.key: entry for chunk, future in zip(chunks, futures, strict=True)
                     if (entry := future.result()) is not None}
        with self._lock:
            self.durable_reads += len(read_here)
        return read_here

    def _decoded(self, chunk: ChunkLoad, blob: memoryview, dtype: torch.dtype,
                 out: torch.Tensor | None) -> CachedKv:
        """The blob's heads of this rank, checked (checksum, key, token ids) and decoded into `out` (or new)."""
        kv = decode_kv_heads(blob, dtype, self._heads, self.pin_memory, out)
        if kv.header.key != chunk.key or kv.header.token_ids != chunk.token_ids:
            raise CorruptKvBlob(f"{chunk.key}: a blob of another key or other tokens was stored under its name")
        return CachedKv(kv.keys, kv.values, kv.header.token_ids)

    def _fetch_streams(self, user_id: str, user_token: str, chunks: Sequence[ChunkLoad], dtype: torch.dtype,
                       buffers: dict[KvKey, torch.Tensor], timeout_s: float) -> dict[KvKey, CachedKv]:
        """`chunks` over the concurrent FetchKv calls, split between them in order."""
        ordered = sorted(chunks, key=lambda chunk: not chunk.key.is_header)  # the header, if any, first
        count = min(self.streams, len(ordered))
        groups = [ordered[len(ordered) * index // count: len(ordered) * (index + 1) // count]
                  for index in range(count)]
        fetches, pool = self._connections()
        state = _Streams()
        futures = [pool.submit(self._fetch_group, fetches[index], user_id, user_token, group, dtype, state, buffers,
                               timeout_s) for index, group in enumerate(groups[1:], start=1)]
        fetched = self._fetch_group(fetches[0], user_id, user_token, groups[0], dtype, state, buffers, timeout_s)
        for future in futures:
            fetched.update(future.result())
        if state.error is not None:
            raise state.error
        return fetched

    def _fetch_group(self, fetch: Callable[..., Any], user_id: str, user_token: str, group: Sequence[ChunkLoad],
                     dtype: torch.dtype, state: _Streams, buffers: dict[KvKey, torch.Tensor],
                     timeout_s: float) -> dict[KvKey, CachedKv]:
        """One FetchKv call for `group` (the header first, if in it), each blob checked and decoded as it comes; what
        it fetched before the first failure of any stream (which `state` keeps, cancelling every stream)."""
        header = group[0] if group[0].key.is_header else None
        facts = group[1:] if header else group
        request = pb.FetchKvRequest(
            profile_id=group[0].key.profile_id, user_id=user_id, user_token=user_token,
            include_header=header is not None,
            header_content_id=header.key.content_id if header else "",
            facts=[pb.FactRef(fact_id=c.key.fact_id, version=c.key.version, content_id=c.key.content_id)
                   for c in facts])
        fetched: dict[KvKey, CachedKv] = {}
        try:
            call = state.started(fetch(request, timeout=timeout_s))
            replies = iter(call)
            for chunk in group:
                reply = next(replies, None)
                if state.error is not None:
                    break
                if reply is None:
                    raise LookupError(f"memory service sent {len(fetched)} KV entries for {len(group)} requested")
                blob = fetch_reply_blob(reply)
                if not blob:
                    raise LookupError(f"memory service has no KV for {chunk.key}")
                fetched[chunk.key] = self._decoded(chunk, blob, dtype, buffers.get(chunk.key))
            else:
                if next(replies, None) is not None:
                    raise LookupError(f"memory service sent more KV entries than the {len(group)} requested")
        except Exception as error:  # kept for the caller, which raises the first
            state.failed(error)
        return fetched

    def _readers(self) -> ThreadPoolExecutor:
        """The threads that read the durable tier (made once): file and socket reads, checksums and copies all run
        in native code without the GIL, so they read in parallel."""
        with self._lock:
            if self._reader_pool is None:
                self._reader_pool = ThreadPoolExecutor(max_workers=DURABLE_READERS, thread_name_prefix="kv-read")
            return self._reader_pool

    def _connections(self) -> tuple[list[Callable[..., Any]], ThreadPoolExecutor]:
        """One FetchKv callable per stream, each on a channel with a connection of its own (gRPC shares a connection
        between channels of equal settings unless told not to), made once; and the threads of the extra streams."""
        with self._lock:
            if not self._fetches:
                for _ in range(self.streams):
                    channel = memory_service_channel(self.address, NODE, options=FETCH_CHANNEL_OPTIONS)
                    self._fetches.append(channel.unary_stream(
                        FETCH_KV_METHOD, request_serializer=pb.FetchKvRequest.SerializeToString,
                        response_deserializer=None))
                # The extra streams of every fetch thread's fetches at once; a fetch whose streams wait here still
                # runs one of its own on its thread.
                self._pool = ThreadPoolExecutor(max_workers=4 * self.streams, thread_name_prefix="kv-fetch-stream")
            assert self._pool is not None
            return self._fetches, self._pool


class _Streams:
    """One fetch's concurrent calls: the first error of any of them is kept and cancels them all (a cancelled call's
    own error, CANCELLED, is not the one kept)."""

    def __init__(self) -> None:
        self.error: Exception | None = None
        self._calls: list[grpc.Call] = []
        self._lock = threading.Lock()

    def started(self, call: grpc.Call) -> grpc.Call:
        with self._lock:
            self._calls.append(call)
            cancelled = self.error is not None
        if cancelled:
            call.cancel()
        return call

    def failed(self, error: Exception) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            calls = list(self._calls)
        for call in calls:
            call.cancel()


