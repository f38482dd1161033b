"""Access control: who is calling (a bearer token from a credentials file) and what that caller may touch.

Credentials file (JSON, `--auth-file`), tokens stored only as SHA-256 hex digests:

    {"credentials": [
      {"name": "acme-app", "role": "app", "user_prefix": "acme/", "token_sha256": "9f86d0...",
       "max_facts": 1000000, "max_kv_bytes": 50000000000},
      {"name": "node-pool", "role": "node", "user_prefix": "", "token_sha256": "..."},
      {"name": "workers", "role": "worker", "token_sha256": "..."}]}

Roles name the RPCs a credential may call, and only workers write KV (a header with AnnounceProfile, fact KV with
CompleteKvWork): a node, an app or an admin credential that sends KV is refused. `user_prefix` is its tenant's user
namespace: every user_id it names must start with it ("" = every user); it ends with a separator (`acme/`, not
`acme`, which would also admit `acme2/...`).
Workers and admins see every user's facts by nature, so they take no prefix.
`max_facts` and `max_kv_bytes` (optional, prefixed credentials only) are the tenant's quotas: an IngestFacts that
would create facts past `max_facts`, or that comes while the tenant's stored KV is at `max_kv_bytes`, is
RESOURCE_EXHAUSTED.
A worker's worker_id / announcer_id must be its credential's name or `name/<process>`: the KV audit tells producer
and auditor apart by credential, so it proves something only with one credential per independent worker.
`python -m memory_service.access` prints the digest of a token read from standard input.
Health and reflection are not behind this check: they carry no user data, and probes and operators need them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import sys
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import Message

from inferscale_kv.call_credentials import AUTHORIZATION_KEY
from memory_service.config import ConfigError
from memory_service.errors import InvalidArgument, PermissionDenied, Unauthenticated
from memory_service.user_tokens import TOKEN_FIELD as USER_TOKEN_FIELD
from memory_service.user_tokens import UserTokens

# The RPCs each role may call. Apps own their users' data; nodes read it on the request path; workers fill in KV.
ROLE_METHODS: dict[str, frozenset[str]] = {
    "app": frozenset({"IngestTurns", "IngestFacts", "SearchFacts", "ListFacts", "DeleteFacts", "DeleteUser",
                      "GetStats"}),
    "node": frozenset({"RetrieveAndStage", "RetrieveAndStageBatch", "FetchKv", "AnnounceProfile"}),
    "worker": frozenset({"AnnounceProfile", "LeaseKvWork", "CompleteKvWork", "GetStats"}),
}
# The roles whose credentials may upload KV; without access control, the role a request declares must be one of them.
KV_WRITER_ROLES = frozenset({"worker"})
ALL_USERS_ROLES = frozenset({"worker", "admin"})
ROLES = frozenset(ROLE_METHODS) | {"admin"}
# Between a worker credential's name and one of its processes in the worker ids it claims (`workers-a/gpu-0`).
WORKER_PROCESS_SEPARATOR = "/"
_PREFIX_PATTERN = re.compile(r"[A-Za-z0-9._:@+/=-]+")
# A token as RFC 6750 writes one (b64token): the only tokens a credentials file may name
# (`python -m memory_service.access` refuses others).
TOKEN_PATTERN = r"[A-Za-z0-9._~+/-]+=*"
# One bearer token after the scheme (any case, RFC 7235): no list of tokens, no spaces, nothing after it.
_BEARER_TOKEN = re.compile(r"(?i:bearer) (" + TOKEN_PATTERN + ")")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    name: str
    role: str
    user_prefix: str
    token_sha256: str
    max_facts: int | None = None
    max_kv_bytes: int | None = None

    def authorize_method(self, method: str) -> None:
        """Raises PermissionDenied unless this caller may call `method` (for some users)."""
        if self.role != "admin" and method not in ROLE_METHODS[self.role]:
            raise PermissionDenied(f"credential {self.name!r} (role {self.role}) may not call {method}")

    def authorize(self, method: str, request: Message) -> None:
        """Raises PermissionDenied unless this caller may call `method` for the users `request` names."""
        self.authorize_method(method)
        if not self.user_prefix or "user_id" not in request.DESCRIPTOR.fields_by_name:
            return
        user_id = request.user_id
        if not user_id and method == "GetStats":
            raise PermissionDenied(f"GetStats: credential {self.name!r} must name one of its users (user_id)")
        if user_id and not user_id.startswith(self.user_prefix):
            raise PermissionDenied(f"user_id {user_id!r} is outside credential {self.name!r}'s users "
                                   f"(prefix {self.user_prefix!r})")

    def worker_identity(self, claimed: str, field: str) -> str:
        """The worker identity a KV writer's request claims (`field`: worker_id, announcer_id), bound to this
        credential: the credential's name, claimed as the name itself or as `name/<process>` (one credential may run
        several processes of one worker), else PermissionDenied. Producer and auditor are told apart by this
        identity, so a credential never audits its own KV. Without access control the claim is all there is (the
        audit then cannot tell workers apart)."""
        if self is OPEN_ACCESS:
            return claimed
        if claimed != self.name and not claimed.startswith(self.name + WORKER_PROCESS_SEPARATOR):
            raise PermissionDenied(f"{field}: {claimed[:40]!r} is not credential {self.name!r}'s worker (use "
                                   f"{self.name!r} or {self.name + WORKER_PROCESS_SEPARATOR + '<process>'!r})")
        return self.name

    def authorize_kv_upload(self, field: str, declared_role: str) -> None:
        """Only workers write KV: raises PermissionDenied unless this caller's credential has a KV writer's role, and
        InvalidArgument unless the request declares one (`declared_role`, e.g. "worker" for PROFILE_ROLE_WORKER;
        CompleteKvWork declares "worker" by its nature), which without access control is all there is to check.
        `field` names the KV in the message."""
        if self is not OPEN_ACCESS and self.role not in KV_WRITER_ROLES:
            raise PermissionDenied(f"{field}: credential {self.name!r} (role {self.role}) may not upload KV; only "
                                   f"{', '.join(sorted(KV_WRITER_ROLES))} credentials do")
        if declared_role not in KV_WRITER_ROLES:
            raise InvalidArgument(field, f"only a precompute worker uploads KV (the request declares role "
                                  f"{declared_role or 'unspecified'}; nodes and apps leave it empty)")


OPEN_ACCESS = Principal(name="anonymous", role="admin", user_prefix="", token_sha256="")
# The caller of the RPC being served (set by the servicer's rpc wrapper for the handler it calls).
CALLER: ContextVar[Principal] = ContextVar("caller", default=OPEN_ACCESS)


class AccessControl:
    """Authenticates calls by their bearer token and authorizes them for the users they name. Without credentials
    every call is admitted (development). With `user_tokens`, a node reads only the user a valid user token of the
    call names (memory_service.user_tokens)."""

    def __init__(self, principals: Iterable[Principal] = (), user_tokens: UserTokens | None = None) -> None:
        self.principals = tuple(principals)
        self.user_tokens = user_tokens

    @property
    def enabled(self) -> bool:
        return bool(self.principals)

    @property
    def header_witnesses(self) -> int:
        """How many worker identities must agree on a profile's memory header before it is served: 2 where the
        credentials file names several KV writers, so that no one of them alone decides what every user's prompt
        starts with; 1 where a single worker is trusted (one writer credential, or no access control at all)."""
        writers = sum(1 for principal in self.principals if principal.role in KV_WRITER_ROLES)
        return 2 if writers >= 2 else 1

    @classmethod
    def from_file(cls, path: Path | None, user_tokens: UserTokens | None = None) -> AccessControl:
        if path is None:
            return cls()
        try:
            entries = json.loads(Path(path).read_text())["credentials"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--auth-file {path}: not a credentials file ({exc})") from exc
        principals = [_principal(entry, index, path) for index, entry in enumerate(entries)]
        if not principals:
            raise ConfigError(f"--auth-file {path}: no credentials (omit the flag to run without access control)")
        names = [principal.name for principal in principals]
        if len(set(names)) != len(names):
            raise ConfigError(f"--auth-file {path}: credential names must be unique")
        if len({principal.token_sha256 for principal in principals}) != len(principals):
            raise ConfigError(f"--auth-file {path}: two credentials share a token")
        return cls(principals, user_tokens)

    def authorize(self, principal: Principal, method: str, request: Message) -> None:
        """Raises PermissionDenied unless `principal` may call `method` for the users `request` names
        (Principal.authorize) and, where user tokens are required, holds a valid one naming the request's user."""
        principal.authorize(method, request)
        if self.user_tokens is not None and "user_id" in request.DESCRIPTOR.fields_by_name:
            self.user_tokens.authorize(principal.role, method, request.user_id,
                                       getattr(request, USER_TOKEN_FIELD, ""))

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Principal:
        """The caller named by the call's metadata entries: exactly one `authorization` entry, whose value is exactly
        `Bearer <token>` (the scheme in any case, one RFC 6750 token); Unauthenticated otherwise. Two entries are
        refused even without access control, where no credential is checked: no call is answered for one credential
        while carrying another."""
        values = [value for key, value in metadata if key == AUTHORIZATION_KEY]
        if len(values) > 1:
            raise Unauthenticated(f"{len(values)} `authorization` metadata entries: send exactly one credential")
        if not self.enabled:
            return OPEN_ACCESS
        header = values[0] if values else ""
        token = _BEARER_TOKEN.fullmatch(header) if isinstance(header, str) else None
        if token is None:
            raise Unauthenticated("missing credential: send `authorization: Bearer <token>` metadata (one token)"
                                  if not header else
                                  "malformed credential: `authorization` must be `Bearer <token>`, one token")
        presented = token_digest(token.group(1)).encode()
        matched: Principal | None = None
        for principal in self.principals:  # every digest is compared, so timing does not tell which one matched
            if hmac.compare_digest(presented, principal.token_sha256.encode()):
                matched = principal
        if matched is None:
            raise Unauthenticated("unknown credential")
        return matched


def _principal(entry: object, index: int, path: Path) -> Principal:
    where = f"--auth-file {path}: credentials[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be an object")
    name, role = entry.get("name"), entry.get("role")
    prefix, digest = entry.get("user_prefix", ""), str(entry.get("token_sha256", "")).lower()
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: required")
    if role not in ROLES:
        raise ConfigError(f"{where}.role: one of {', '.join(sorted(ROLES))}")
    if not isinstance(prefix, str) or (prefix and role in ALL_USERS_ROLES):
        raise ConfigError(f"{where}.user_prefix: a string, and empty for role {role} (it sees every user)")
    if prefix and not _PREFIX_PATTERN.fullmatch(prefix):
        raise ConfigError(f"{where}.user_prefix: letters, digits and ._:@+/=- only")
    if prefix and prefix[-1].isalnum():
        # "acme" would also admit "acme2/...": a namespace ends with a separator ("acme/").
        raise ConfigError(f"{where}.user_prefix: must end with one of ._:@+/=- (e.g. {prefix + '/'!r}), so that it "
                          "cannot also match other tenants' ids")
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ConfigError(f"{where}.token_sha256: the token's SHA-256 as 64 hex digits")
    quotas = {quota: entry.get(quota) for quota in ("max_facts", "max_kv_bytes")}
    for quota, value in quotas.items():
        if value is not None and (not prefix or not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{where}.{quota}: a positive integer, on a credential with a user_prefix")
    return Principal(name=name, role=role, user_prefix=prefix, token_sha256=digest, **quotas)


if __name__ == "__main__":
    token = sys.stdin.readline().rstrip("\n")
    if not re.fullmatch(TOKEN_PATTERN, token):
        sys.exit("a token is letters, digits and -._~+/ (then '=' padding, if any): RFC 6750's form, which "
                 "`authorization: Bearer <token>` carries")
    print(token_digest(token))
