"""Where the service keeps facts, turns, embeddings and fact KV: a local directory (the embedded default) or an
S3-compatible object store shared by every replica (`--store-uri s3://bucket/prefix`). The caller never knows which:
`StoreLocation` gives LanceDB's URI and options and the durable KV tier.

Object-store credentials come from the standard environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); the
endpoint, region and plain-HTTP permission from the service's flags. LanceDB commits on the store rely on
conditional writes (put-if-absent), which the store must honour (AWS S3, MinIO and SeaweedFS do).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from inferscale_kv.blob_names import blob_name, key_of_blob_name
from inferscale_kv.eviction import LruEviction
from inferscale_kv.kv_key import KvKey
from memory_service.kv_tiers import AdmitAll, DiskTier, KvTier

_S3_URI = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>.*?))?/?")


@dataclass(frozen=True)
class S3Settings:
    endpoint: str = ""  # empty: AWS's own
    region: str = "us-east-1"
    allow_http: bool = False

    def storage_options(self) -> dict[str, str]:
        """LanceDB's (object_store crate's) options for this store."""
        options = {"aws_region": self.region}
        if self.endpoint:
            options["aws_endpoint"] = self.endpoint
        if self.allow_http:
            options["allow_http"] = "true"
        for variable, option in (("AWS_ACCESS_KEY_ID", "aws_access_key_id"),
                                 ("AWS_SECRET_ACCESS_KEY", "aws_secret_access_key")):
            if os.environ.get(variable):
                options[option] = os.environ[variable]
        return options

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint or None, region_name=self.region,
                            config=Config(retries={"max_attempts": 3, "mode": "standard"},
                                          max_pool_connections=32, connect_timeout=5, read_timeout=30))


@dataclass(frozen=True)
class StoreLocation:
    """A local directory, or a bucket and key prefix of an S3-compatible store."""

    local_dir: Path | None = None
    bucket: str = ""
    prefix: str = ""
    s3: S3Settings = field(default_factory=S3Settings)

    @classmethod
    def parse(cls, store_uri: str, data_dir: Path, s3: S3Settings) -> StoreLocation:
        """`s3://bucket/prefix`, or a local path (empty: `data_dir`)."""
        if store_uri.startswith("s3://"):
            match = _S3_URI.fullmatch(store_uri)
            if match is None:
                raise ValueError(f"{store_uri!r} is not s3://BUCKET[/PREFIX]")
            return cls(bucket=match["bucket"], prefix=(match["prefix"] or "").strip("/"), s3=s3)
        if "://" in store_uri:
            raise ValueError(f"{store_uri!r}: expected s3://BUCKET[/PREFIX] or a local directory")
        return cls(local_dir=Path(store_uri) if store_uri else data_dir)

    @property
    def shared(self) -> bool:
        return self.local_dir is None

    def _key(self, *parts: str) -> str:
        return "/".join(part for part in (self.prefix, *parts) if part)

    @property
    def lancedb_uri(self) -> str:
        if self.local_dir is None:
            return f"s3://{self.bucket}/{self._key('lancedb')}"
        return str(self.local_dir / "lancedb")

    @property
    def lancedb_options(self) -> dict[str, str] | None:
        return self.s3.storage_options() if self.shared else None

    def durable_kv_tier(self, disk_budget_bytes: int) -> KvTier:
        """The tier every stored blob is written to first: files under <dir>/kv/blobs (within `disk_budget_bytes`),
        or objects under <prefix>/kv/ (unbounded: the bucket is the limit)."""
        if self.local_dir is None:
            return ObjectStoreTier(self.s3.client(), self.bucket, self._key("kv"))
        return DiskTier(self.local_dir / "kv" / "blobs", disk_budget_bytes, LruEviction(), AdmitAll())

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.shared else str(self.local_dir)


class ObjectStoreTier(KvTier):
    """Durable tier in a bucket shared by every replica: one object per blob, named like the disk tier's files; reads
    check each blob (checksum, key). It never evicts (its budget is the bucket's) and keeps no local index: an S3 PUT
    replaces an object atomically. Its counters are this replica's traffic, not the bucket's content (other replicas
    write it too). `requests` counts the calls made to the store."""

    def __init__(self, client, bucket: str, prefix: str) -> None:
        super().__init__("object-store", sys.maxsize)
        self._client = client
        self.bucket = bucket
        self.prefix = prefix
        self.requests = 0

    def _object(self, key: KvKey) -> str:
        return f"{self.prefix}/{blob_name(key)}"

    def _request(self) -> None:
        with self._lock:
            self.requests += 1

    def _head(self, key: KvKey) -> int | None:
        from botocore.exceptions import ClientError

        self._request()
        try:
            return self._client.head_object(Bucket=self.bucket, Key=self._object(key))["ContentLength"]
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def contains(self, key: KvKey) -> bool:
        return self._head(key) is not None

    def get(self, key: KvKey) -> bytes | None:
        self._request()
        try:
            blob = self._client.get_object(Bucket=self.bucket, Key=self._object(key))["Body"].read()
        except self._client.exceptions.NoSuchKey:
            self._count_lookup(hit=False)
            return None
        self._count_lookup(hit=True)
        return self._verified(key, blob)

    def put(self, key: KvKey, blob: bytes, *, pinned: bool = False) -> bool:
        self._request()
        self._client.put_object(Bucket=self.bucket, Key=self._object(key), Body=blob)
        with self._lock:
            self.stats.entries += 1
            self.stats.bytes += len(blob)
        return True

    def remove(self, key: KvKey) -> bool:
        size = self._head(key)
        if size is None:
            return False
        self._request()
        self._client.delete_object(Bucket=self.bucket, Key=self._object(key))
        with self._lock:
            self.stats.entries = max(0, self.stats.entries - 1)
            self.stats.bytes = max(0, self.stats.bytes - size)
        return True

    def keys(self) -> Iterator[KvKey]:
        """Every blob in the store (a listing: for tests and tools, not the request path)."""
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{self.prefix}/"):
            self._request()
            for item in page.get("Contents", []):
                key = key_of_blob_name(item["Key"][len(self.prefix) + 1:])
                if key is not None:
                    yield key
