"""Fact KV read straight from the memory service's durable tier, where the node is given it (`--kv-durable-tier`):
its KV directory or its bucket, read-only. The byte path (kv_fetch.MemoryServiceKv) reads each chunk's blob there by
the name the service stores it under (inferscale_kv.blob_names) and asks the service over FetchKv only for those
the tier lacks: a file or an object read by native code, several at once, instead of megabyte gRPC replies a single
service process sends under its GIL (benchmarks/RESULTS.md, "Straight from the durable tier").

Nothing changes what may be loaded: the node reads only the keys of plans the service's index named, checks every
blob (checksum, key, token ids) before it enters a tier, and the service removes a blob from its durable tier before
a delete, a quarantine or an eviction is acknowledged, so a blob it no longer lists is not there to read.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, Protocol

from inferscale_kv.blob_names import blob_name
from inferscale_kv.kv_key import KvKey

MAX_BLOB_BYTES = 256 << 20  # as FetchKv's largest reply (kv_fetch.FETCH_CHANNEL_OPTIONS)
_S3_LOCATION = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>.*))?")


class DurableBlobs(Protocol):
    def read(self, key: KvKey) -> memoryview | None:
        """The bytes stored under `key`'s name, unchecked, or None where the tier has none (never stored yet,
        evicted or deleted: the caller asks the memory service). Raises OSError (or the store's client error) when
        the tier cannot be read. Thread-safe."""
        ...


class DirectoryBlobs:
    """The service's KV directory (`<--data-dir>/kv/blobs`), mounted read-only: one file per blob, each replaced
    whole by a rename, so a read sees one whole blob."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def read(self, key: KvKey) -> memoryview | None:
        """Also None for a name that is not a stored blob's; OSError for anything but a regular file of at most
        MAX_BLOB_BYTES (a link, a pipe, a device)."""
        name = blob_name(key)
        if any(part in ("", ".", "..") for part in name.split("/")):
            return None  # never a stored blob's name (ids start with a letter or digit): never outside the root
        try:
            descriptor = os.open(self.root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        with os.fdopen(descriptor, "rb", buffering=0) as file:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_BLOB_BYTES:
                raise OSError(f"{name}: not a regular file of at most {MAX_BLOB_BYTES} bytes")
            buffer = memoryview(bytearray(status.st_size))
            size = 0
            while size < len(buffer) and (count := file.readinto(buffer[size:])):
                size += count
        return buffer[:size]  # a file cut short fails its checksum


class BucketBlobs:
    """The service's bucket (`s3://BUCKET/PREFIX/kv`, the service's --store-uri and /kv), with read-only
    credentials: one object per blob, read by obstore (Rust's object_store: the body lands in one buffer, without
    the GIL; on 2 cores beside SeaweedFS 1.0 GB/s on 4 threads at 0.57 client CPU s/GB, boto3 0.72 at 1.09)."""

    def __init__(self, bucket: str, prefix: str, store: Any) -> None:
        self.bucket, self.prefix = bucket, prefix
        self._store = store

    def read(self, key: KvKey) -> memoryview | None:
        import obstore

        try:
            return memoryview(obstore.get(self._store, blob_name(key)).bytes())
        except FileNotFoundError:
            return None


def durable_blobs(location: str, timeout_s: float = 10.0) -> DurableBlobs | None:
    """The durable tier at `location` (a directory, or s3://BUCKET/PREFIX with the endpoint in AWS_ENDPOINT_URL and
    credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; a bucket read waits on its socket at most
    `timeout_s`, once); None where empty. ValueError for a location that is neither."""
    if not location:
        return None
    if location.startswith("s3://"):
        match = _S3_LOCATION.fullmatch(location)
        if match is None:
            raise ValueError(f"--kv-durable-tier: {location!r} is not s3://BUCKET[/PREFIX]")
        from obstore.store import S3Store

        bucket, prefix = match["bucket"], (match["prefix"] or "").strip("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        store = S3Store(bucket, prefix=prefix or None,
                        client_options={"allow_http": endpoint.startswith("http://"),
                                        "connect_timeout": f"{min(5.0, timeout_s)}s", "timeout": f"{timeout_s}s"},
                        retry_config={"max_retries": 0})
        return BucketBlobs(bucket, prefix, store)
    if "://" in location:
        raise ValueError(f"--kv-durable-tier: {location!r} is neither a directory nor s3://BUCKET[/PREFIX]")
    return DirectoryBlobs(Path(location).resolve())
