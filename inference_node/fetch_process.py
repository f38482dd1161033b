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
import json
import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
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
# How long past its memory-service deadline a fetch waits for the child's answer before giving up on it.
ANSWER_MARGIN_S = 5.0
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
        aligned = [-(-size // _ALIGNMENT) * _ALIGNMENT for size in sizes]
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
        aligned = [-(-size // _ALIGNMENT) * _ALIGNMENT for size in sizes]
        with self._room:
            merged: list[tuple[int, int]] = []
            for offset, size in sorted([*self._free, *zip(offsets, aligned, strict=True)]):
                if merged and merged[-1][0] + merged[-1][1] == offset:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((offset, size))
            self._free = merged
            self._room.notify_all()


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
    pending: dict[int, _Pending] = field(default_factory=dict)


class FetchProcessKv:
    """A KvSource whose fetches run in a child process (`python -m inference_node.fetch_process`), started now and
    again by the first fetch after it exits; this rank's heads `heads` (of the model's) at `rank_shape`."""

    def __init__(self, address: str, timeout_s: float, heads: slice, rank_shape: KvShape,
                 pin_memory: bool | None = None, arena_bytes: int = FETCH_ARENA_BYTES) -> None:
        self.address = address
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
        self._lock = threading.Lock()  # the child and its pending requests
        self._child: _Child | None = None
        self._ids = 0
        with self._lock:
            self._running()

    def fetch(self, user_id: str, chunks: Sequence[ChunkLoad], dtype: torch.dtype) -> list[CachedKv]:
        fetched: list[CachedKv] = []
        part: list[ChunkLoad] = []
        part_bytes = 0
        for chunk in chunks:
            if part and part_bytes + self._size(chunk, dtype) > self._part_bytes:
                fetched += self._fetch_part(user_id, part, dtype)
                part, part_bytes = [], 0
            part.append(chunk)
            part_bytes += self._size(chunk, dtype)
        if part:
            fetched += self._fetch_part(user_id, part, dtype)
        return fetched

    @property
    def process_id(self) -> int | None:
        """The running fetch process's pid (None before the first or after it exited)."""
        with self._lock:
            return self._child.process.pid if self._child is not None else None

    def _size(self, chunk: ChunkLoad, dtype: torch.dtype) -> int:
        """Bytes of the chunk's keys and values at this rank's shape."""
        return self.rank_shape.elements_per_token() * len(chunk.token_ids) * dtype.itemsize

    def _fetch_part(self, user_id: str, chunks: Sequence[ChunkLoad], dtype: torch.dtype) -> list[CachedKv]:
        sizes = [self._size(chunk, dtype) for chunk in chunks]
        offsets = self._arena.allocate(sizes, self.timeout_s)
        pending = _Pending(offsets, sizes)
        try:
            request_id = self._send(pending, {
                "user_id": user_id, "dtype": str(dtype).removeprefix("torch."),
                "chunks": [{"key": [chunk.key.profile_id, chunk.key.user_id, chunk.key.fact_id, chunk.key.version,
                                    chunk.key.content_id],
                            "token_ids": list(chunk.token_ids), "offset": offset}
                           for chunk, offset in zip(chunks, offsets, strict=True)]})
        except BaseException:
            self._arena.free(offsets, sizes)
            raise
        waited_s = self.timeout_s + ANSWER_MARGIN_S
        if not pending.answered.wait(waited_s):
            with pending.lock:
                if not pending.answered.is_set():
                    pending.abandoned = True  # the reader frees the regions when the answer comes
                    raise TimeoutError(f"the fetch process did not answer request {request_id} within "
                                       f"{waited_s:.1f} s")
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

    def _send(self, pending: _Pending, request: dict[str, Any]) -> int:
        with self._lock:
            child = self._running()
            self._ids += 1
            request_id = self._ids
            child.pending[request_id] = pending
            try:
                send_message(child.control, {"id": request_id, **request})
            except OSError as error:
                del child.pending[request_id]
                raise KvFetchFailed(f"the KV fetch process cannot be reached ({error})") from error
        return request_id

    def _running(self) -> _Child:
        """The running child, starting one when none runs (the lock held)."""
        if self._child is not None and self._child.process.poll() is None:
            return self._child
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "inference_node.fetch_process",
                   "--address", self.address, "--timeout-s", str(self.timeout_s),
                   "--heads", f"{self._heads.start}:{self._heads.stop}", "--layers", str(self.rank_shape.num_layers),
                   "--head-dim", str(self.rank_shape.head_dim), "--arena-fd", str(self._memory_file),
                   "--arena-bytes", str(self._arena.size), "--control-fd", str(theirs.fileno())]
        try:
            process = subprocess.Popen(command, pass_fds=(self._memory_file, theirs.fileno()),
                                       stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._child = _Child(process, ours)
        threading.Thread(target=self._read_answers, args=(self._child,), daemon=True,
                         name="inferscale-fetch-answers").start()
        return self._child

    def _read_answers(self, child: _Child) -> None:
        """Hands each of the child's answers to its waiter until the child exits; then fails what it left
        unanswered."""
        while (answer := receive_message(child.control)) is not None:
            with self._lock:
                pending = child.pending.pop(answer["id"], None)
            if pending is not None:
                self._answer(pending, answer)
        code = child.process.wait()
        logger.warning("InferScale: the KV fetch process exited (code %s); its fetches in flight fail", code)
        with self._lock:
            unanswered, child.pending = child.pending, {}
        child.control.close()
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
        """Stops the child and waits for it (a worker's child also ends with the worker's process: its socket
        closes)."""
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            child.control.shutdown(socket.SHUT_RDWR)
            child.process.wait(timeout=30)


def _serve(arguments: argparse.Namespace) -> None:
    """The child: fetches what each request names into the arena regions it names, answering each (in any order)."""
    from inference_node.kv_fetch import MemoryServiceKv

    memory = mmap.mmap(arguments.arena_fd, arguments.arena_bytes)
    arena = torch.frombuffer(memory, dtype=torch.uint8)
    first, last = (int(bound) for bound in arguments.heads.split(":"))
    source = MemoryServiceKv(arguments.address, arguments.timeout_s, slice(first, last), pin_memory=False)
    control = socket.socket(fileno=arguments.control_fd)
    answering = threading.Lock()

    def region(offset: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        shape = (2, arguments.layers, tokens, last - first, arguments.head_dim)
        size = 2 * arguments.layers * tokens * (last - first) * arguments.head_dim * dtype.itemsize
        if offset < 0 or offset + size > arguments.arena_bytes:
            raise ValueError(f"a region [{offset}, {offset + size}) outside the arena")
        return arena[offset: offset + size].view(dtype).view(shape)

    def fetch(request: dict[str, Any]) -> None:
        answer: dict[str, Any] = {"id": request["id"], "error": None}
        try:
            dtype = _DTYPES[request["dtype"]]
            chunks = [ChunkLoad(KvKey(*item["key"]), tuple(item["token_ids"]), 0) for item in request["chunks"]]
            into = [region(item["offset"], len(chunk.token_ids), dtype)
                    for item, chunk in zip(request["chunks"], chunks, strict=True)]
            source.fetch(request["user_id"], chunks, dtype, into)
        except Exception as error:  # answered: the worker raises it again
            name = type(error).__name__
            answer["error"] = {"type": name if name in _ERRORS else "KvFetchFailed", "message": f"{name}: {error}"}
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
    _serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
