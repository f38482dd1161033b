"""The node's fetches, out of vLLM's engine process: a child process per worker rank runs `MemoryServiceKv` (its gRPC
streams, checksums and decoding) and writes each chunk's KV heads into a shared-memory arena that the worker maps too;
the worker's fetch threads only send a request, wait on a socket with the GIL released and copy the decoded heads out
in one native copy. In the engine's process the threads of a fetch took the GIL from the engine at every gRPC read
and decode, and a prefill running beside a cold user's fetch took 185-364 ms where it takes 27 (benchmarks/RESULTS.md,
issue 41's H200 run).

- The arena is an anonymous memory file (`memfd_create`) handed to the child with the control socket (`pass_fds`); no
  path, nothing another process can open.
- The worker allocates each chunk's region before it asks (it knows every chunk's size at its rank's shape), so the
  child writes only where it is told, and a region is freed only once the child answered for it or exited.
- The control socket carries one length-prefixed JSON message per request and per answer. A child that exits (or
  never starts) fails the fetches in flight, as an unreachable service would; the next fetch starts another.
- The child holds the node's memory-service credentials from the environment it inherits, like the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from inference_node.kv_fetch import CachedKv
from inference_node.plan import ChunkLoad
from inferscale_kv.blob import CorruptKvBlob
from inferscale_kv.kv_key import KvKey
from inferscale_kv.shape import KvShape

logger = logging.getLogger(__name__)

# The shared arena per worker rank: what the fetches in flight (two fetch threads and the warm-up's) hold at once. A
# fetch larger than a quarter of it goes in parts, each waiting for room.
FETCH_ARENA_BYTES = 512 << 20
# How long past its deadline a fetch waits for the child's answer before giving up on it (and on the child).
ANSWER_MARGIN_S = 5.0
# A child that exits within this long of its start is not replaced before this long has passed.
RESTART_BACKOFF_S = 5.0
_ALIGNMENT = 4096
_LENGTH = struct.Struct("<I")
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16)}
# Errors the child reports by name, raised again by their type in the worker (any other: KvFetchFailed).
_ERRORS: dict[str, type[Exception]] = {"CorruptKvBlob": CorruptKvBlob, "LookupError": LookupError,
                                       "TimeoutError": TimeoutError, "ValueError": ValueError}


class KvFetchFailed(RuntimeError):
    """The fetch process failed a fetch for a reason of its own (the memory service refused or was unreachable, or
    the fetch process exited); the message says which."""


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive_message(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None once the other end closed the socket."""
    prefix = _receive_exactly(sock, _LENGTH.size)
    if prefix is None:
        return None
    data = _receive_exactly(sock, _LENGTH.unpack(prefix)[0])
    return json.loads(data) if data is not None else None


def _receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            return None
        received += count
    return bytes(buffer)


class _Arena:
    """First-fit allocation of aligned regions of the shared memory file, coalesced on free. Thread-safe; `allocate`
    waits for room."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size), by offset
        self._room = threading.Condition()

    def allocate(self, sizes: Sequence[int], timeout_s: float) -> list[int]:
        """One region per size, all at once (never a part of them held while waiting); TimeoutError if the arena has
        no room for them within `timeout_s`."""
        if not sizes:
            return []
        aligned = _aligned(sizes)
        if sum(aligned) > self.size:
            raise ValueError(f"{sum(aligned)} bytes asked of an arena of {self.size}")
        with self._room:
            offsets = self._room.wait_for(lambda: self._take(aligned), timeout=timeout_s)
        if not offsets:
            raise TimeoutError(f"no room for {sum(aligned)} bytes in the fetch arena within {timeout_s:.1f} s")
        return offsets

    def _take(self, sizes: Sequence[int]) -> list[int] | None:
        free, offsets = list(self._free), []
        for size in sizes:
            index = next((i for i, (_, room) in enumerate(free) if room >= size), None)
            if index is None:
                return None
            offset, room = free[index]
            offsets.append(offset)
            free[index: index + 1] = [(offset + size, room - size)] if room > size else []
        self._free = free
        return offsets

    def free(self, offsets: Sequence[int], sizes: Sequence[int]) -> None:
        aligned = _aligned(sizes)
        with self._room:
            merged: list[tuple[int, int]] = []
            for offset, size in sorted([*self._free, *zip(offsets, aligned, strict=True)]):
                if merged and merged[-1][0] + merged[-1][1] == offset:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((offset, size))
            self._free = merged
            self._room.notify_all()


def _aligned(sizes: Sequence[int]) -> list[int]:
    """Each size rounded up to the arena's alignment (what a region of that size takes)."""
    return [-(-size // _ALIGNMENT) * _ALIGNMENT for size in sizes]


@dataclass
class _Pending:
    """A request the child has not answered: its regions are freed when the answer comes, by the waiting thread
    once it copied them out, or by the reader if the waiter gave up (`abandoned`)."""

    offsets: list[int]
    sizes: list[int]
    answer: dict[str, Any] | None = None
    abandoned: bool = False
    answered: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Child:
    """One fetch process, its end of the control socket and the requests it has not answered."""

    process: subprocess.Popen[bytes]
    control: socket.socket
    started_at: float
    pending: dict[int, _Pending] = field(default_factory=dict)
    sending: threading.Lock = field(default_factory=threading.Lock)  # one message at a time on the socket
    durable_reads: int = 0  # the most its answers said it read from the durable tier


class FetchProcessKv:
    """A KvSource whose fetches run in a child process (`python -m inference_node.fetch_process`), started now and
    again by the first fetch after it exits (not sooner than RESTART_BACKOFF_S after one that lived less than that);
    this rank's heads `heads` (of the model's) at `rank_shape`. A child that leaves a request unanswered past its
    deadline is killed: its exit frees every region it could still write into and fails its other requests."""

    def __init__(self, address: str, timeout_s: float, heads: slice, rank_shape: KvShape,
                 pin_memory: bool | None = None, arena_bytes: int = FETCH_ARENA_BYTES, durable_tier: str = "") -> None:
        """`durable_tier`: where the child reads fact KV before asking the memory service (--kv-durable-tier)."""
        self.address = address
        self.durable_tier = durable_tier
        self.timeout_s = timeout_s
        self.rank_shape = rank_shape
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._heads = heads
        self._arena = _Arena(arena_bytes)
        self._part_bytes = arena_bytes // 4
        self._memory_file = os.memfd_create("inferscale-kv-fetch", os.MFD_CLOEXEC)
        os.ftruncate(self._memory_file, arena_bytes)
        self._memory = mmap.mmap(self._memory_file, arena_bytes)
        self._bytes = torch.frombuffer(self._memory, dtype=torch.uint8)
        self._lock = threading.Lock()  # the child, its pending requests, the request ids
        self._child: _Child | None = None
        self._restart_at = 0.0  # monotonic: no child is started before
        self._closed = False
        self.processes_started = 0
        self.durable_reads = 0  # chunks the children read from the durable tier, as their answers said
        self._ids = 0
        with self._lock:
            self._running()

    def fetch(self, user_id: str, chunks: Sequence[ChunkLoad], dtype: torch.dtype, *,
              user_token: str = "") -> list[CachedKv]:
        """As KvSource.fetch, within one deadline (`timeout_s` from now, plus ANSWER_MARGIN_S for the child's answer)
        however many parts of the arena it takes."""
        if len({chunk.key for chunk in chunks}) != len(chunks):
            raise ValueError("a fetch names a chunk twice")
        deadline = time.monotonic() + self.timeout_s
        fetched: list[CachedKv] = []
        part: list[ChunkLoad] = []
        part_bytes = 0
        for chunk in chunks:
            if part and part_bytes + self._size(chunk, dtype) > self._part_bytes:
                fetched += self._fetch_part(user_id, user_token, part, dtype, deadline)
                part, part_bytes = [], 0
            part.append(chunk)
            part_bytes += self._size(chunk, dtype)
        if part:
            fetched += self._fetch_part(user_id, user_token, part, dtype, deadline)
        return fetched

    @property
    def process_id(self) -> int | None:
        """The running fetch process's pid (None before the first or after it exited)."""
        with self._lock:
            return self._child.process.pid if self._child is not None else None

    def _size(self, chunk: ChunkLoad, dtype: torch.dtype) -> int:
        """Bytes of the chunk's keys and values at this rank's shape."""
        return self.rank_shape.elements_per_token() * len(chunk.token_ids) * dtype.itemsize

    def _fetch_part(self, user_id: str, user_token: str, chunks: Sequence[ChunkLoad], dtype: torch.dtype,
                    deadline: float) -> list[CachedKv]:
        sizes = [self._size(chunk, dtype) for chunk in chunks]
        offsets = self._arena.allocate(sizes, max(0.0, deadline - time.monotonic()))
        pending = _Pending(offsets, sizes)
        try:
            child, request_id = self._send(pending, {
                "user_id": user_id, "user_token": user_token, "dtype": str(dtype).removeprefix("torch."),
                "timeout_s": max(0.001, deadline - time.monotonic()),
                "chunks": [{"key": [chunk.key.profile_id, chunk.key.user_id, chunk.key.fact_id, chunk.key.version,
                                    chunk.key.content_id],
                            "token_ids": list(chunk.token_ids), "offset": offset, "size": size}
                           for chunk, offset, size in zip(chunks, offsets, sizes, strict=True)]})
        except BaseException:
            self._arena.free(offsets, sizes)
            raise
        if not pending.answered.wait(max(0.0, deadline - time.monotonic()) + ANSWER_MARGIN_S):
            with pending.lock:
                abandoned = pending.abandoned = not pending.answered.is_set()
            if abandoned:  # its regions stay held until the child is gone
                child.process.kill()
                raise TimeoutError(f"the fetch process did not answer request {request_id} in time: stopped")
        try:
            error = pending.answer.get("error") if pending.answer is not None else None
            if error is not None:
                raise _ERRORS.get(error["type"], KvFetchFailed)(error["message"])
            return [self._copied_out(chunk, offset, dtype) for chunk, offset in zip(chunks, offsets, strict=True)]
        finally:
            self._arena.free(offsets, sizes)

    def _copied_out(self, chunk: ChunkLoad, offset: int, dtype: torch.dtype) -> CachedKv:
        """The chunk's keys and values copied out of the arena, each into its own (pinned on CUDA) host tensor."""
        shape = self.rank_shape.of(len(chunk.token_ids))
        half = self._size(chunk, dtype) // 2
        pair = []
        for start in (offset, offset + half):
            tensor = torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
            tensor.view(-1).view(torch.uint8).copy_(self._bytes[start: start + half])
            pair.append(tensor)
        return CachedKv(pair[0], pair[1], chunk.token_ids)

    def _send(self, pending: _Pending, request: dict[str, Any]) -> tuple[_Child, int]:
        with self._lock:
            child = self._running()
            self._ids += 1
            request_id = self._ids
            child.pending[request_id] = pending
        try:
            with child.sending:
                send_message(child.control, {"id": request_id, **request})
        except OSError as error:
            with self._lock:
                child.pending.pop(request_id, None)
            raise KvFetchFailed(f"the KV fetch process cannot be reached ({error})") from error
        return child, request_id

    def _running(self) -> _Child:
        """The running child, starting one when none runs (the lock held); KvFetchFailed while closed or backing
        off from a child that exited young."""
        if self._child is not None and self._child.process.poll() is None:
            return self._child
        if self._closed:
            raise KvFetchFailed("the KV source is closed")
        if time.monotonic() < self._restart_at:
            raise KvFetchFailed("the KV fetch process exited young; starting another after a pause")
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "inference_node.fetch_process",
                   "--address", self.address, "--timeout-s", str(self.timeout_s),
                   "--heads", f"{self._heads.start}:{self._heads.stop}", "--layers", str(self.rank_shape.num_layers),
                   "--head-dim", str(self.rank_shape.head_dim), "--arena-fd", str(self._memory_file),
                   "--arena-bytes", str(self._arena.size), "--control-fd", str(theirs.fileno()),
                   "--durable-tier", self.durable_tier]
        try:
            process = subprocess.Popen(command, pass_fds=(self._memory_file, theirs.fileno()),
                                       stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._child = _Child(process, ours, time.monotonic())
        self.processes_started += 1
        threading.Thread(target=self._read_answers, args=(self._child,), daemon=True,
                         name="inferscale-fetch-answers").start()
        return self._child

    def _read_answers(self, child: _Child) -> None:
        """Hands each of the child's answers to its waiter until the child exits or breaks the protocol (then it is
        killed); then fails what it left unanswered and frees what those requests held."""
        try:
            while (answer := receive_message(child.control)) is not None:
                with self._lock:
                    pending = child.pending.pop(int(answer["id"]), None)
                    reads = int(answer.get("durable_reads", 0))
                    if reads > child.durable_reads:  # answers may come out of order: the largest is the latest
                        self.durable_reads += reads - child.durable_reads
                        child.durable_reads = reads
                if pending is not None:
                    self._answer(pending, answer)
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("InferScale: the KV fetch process's answers broke off (%r)", error)
        finally:
            child.process.kill()
            code = child.process.wait()
            with self._lock:
                unanswered, child.pending = child.pending, {}
                if time.monotonic() - child.started_at < RESTART_BACKOFF_S:
                    self._restart_at = time.monotonic() + RESTART_BACKOFF_S
            child.control.close()
            if not self._closed:
                logger.warning("InferScale: the KV fetch process exited (code %s); %d fetches in flight fail", code,
                               len(unanswered))
            for pending in unanswered.values():
                self._answer(pending, {"error": {"type": "KvFetchFailed",
                                                 "message": f"the KV fetch process exited (code {code})"}})

    def _answer(self, pending: _Pending, answer: dict[str, Any]) -> None:
        with pending.lock:
            pending.answer = answer
            pending.answered.set()
            abandoned = pending.abandoned
        if abandoned:
            self._arena.free(pending.offsets, pending.sizes)

    def close(self) -> None:
        """Stops the child and waits for it (idempotent; fetches fail from now on)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            child = self._child
        os.close(self._memory_file)  # the mapping stays while the arena's tensor lives
        if child is not None:
            with contextlib.suppress(OSError):
                child.control.shutdown(socket.SHUT_RDWR)
            try:
                child.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def _serve(arguments: argparse.Namespace) -> None:
    """The child: fetches what each request names into the arena regions it names, answering each (in any order)."""
    from inference_node.durable_blobs import durable_blobs
    from inference_node.kv_fetch import MemoryServiceKv

    memory = mmap.mmap(arguments.arena_fd, arguments.arena_bytes)
    arena = torch.frombuffer(memory, dtype=torch.uint8)
    first, last = (int(bound) for bound in arguments.heads.split(":"))
    source = MemoryServiceKv(arguments.address, arguments.timeout_s, slice(first, last), pin_memory=False,
                             durable=durable_blobs(arguments.durable_tier, arguments.timeout_s))
    control = socket.socket(fileno=arguments.control_fd)
    answering = threading.Lock()

    def region(offset: int, asked: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        shape = (2, arguments.layers, tokens, last - first, arguments.head_dim)
        size = 2 * arguments.layers * tokens * (last - first) * arguments.head_dim * dtype.itemsize
        if size != asked or offset < 0 or offset + size > arguments.arena_bytes:
            raise ValueError(f"a region [{offset}, {offset + asked}) for {size} bytes of KV in an arena of "
                             f"{arguments.arena_bytes}")
        return arena[offset: offset + size].view(dtype).view(shape)

    def fetch(request: dict[str, Any]) -> None:
        answer: dict[str, Any] = {"id": request["id"], "error": None}
        try:
            dtype = _DTYPES[request["dtype"]]
            chunks = [ChunkLoad(KvKey(*item["key"]), tuple(item["token_ids"]), 0) for item in request["chunks"]]
            into = [region(item["offset"], item["size"], len(chunk.token_ids), dtype)
                    for item, chunk in zip(request["chunks"], chunks, strict=True)]
            source.fetch(request["user_id"], chunks, dtype, into, timeout_s=request["timeout_s"],
                         user_token=request["user_token"])
        except Exception as error:  # answered: the worker raises it again
            name = type(error).__name__
            answer["error"] = {"type": name if name in _ERRORS else "KvFetchFailed", "message": f"{name}: {error}"}
        answer["durable_reads"] = source.durable_reads  # this child's so far
        with answering:
            send_message(control, answer)

    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-fetch")
    while (request := receive_message(control)) is not None:
        pool.submit(fetch, request)
    os._exit(0)  # the worker closed the socket (it exited): nothing is left to answer


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--address", required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--heads", required=True, help="first:last KV head of this rank")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--arena-fd", type=int, required=True)
    parser.add_argument("--arena-bytes", type=int, required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--durable-tier", default="", help="the node's --kv-durable-tier")
    _serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
