"""User-bound node access: the short-lived token a gateway mints for the user it authenticated, which a node forwards
with each RetrieveAndStage and FetchKv call it makes for that user.

The token is a JWT signed with the gateway's private key; the memory service holds only the public key
(`--user-token-public-key-file`, PEM: RSA for RS256, P-256 for ES256, Ed25519 for EdDSA; the algorithm is the key's,
never the token's). A token is valid when its signature verifies, `iss` is `--user-token-issuer`, `aud` is
`--user-token-audience`, it holds `sub`, `iat` and `exp`, has not expired, and lives at most
`--user-token-max-lifetime-s` (`exp - iat`); `aud` must be exactly the audience, not a list holding it. `sub` is the
user it names. With the key configured, a node credential
reads only the user a valid token of that very call names: without one it reads nothing.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from memory_service.config import ConfigError
from memory_service.errors import PermissionDenied

# A token issued this many seconds in the future, or expired this many seconds ago, still passes (clock skew).
CLOCK_SKEW_S = 30
# The roles whose reads are bound to a user token when the service requires them.
USER_BOUND_ROLES = frozenset({"node"})
# The RPCs (and, for RetrieveAndStageBatch, each call's) that read a user's facts or KV on a node's behalf.
USER_BOUND_METHODS = frozenset({"RetrieveAndStage", "FetchKv"})
TOKEN_FIELD = "user_token"
# Tokens whose verification is remembered until they expire (a node sends a request's token with every call of it).
VERIFIED_TOKENS_KEPT = 100_000
# A longer user_token is refused unread (a JWT of a few claims is a few hundred bytes).
MAX_TOKEN_CHARS = 8192


@dataclass(frozen=True)
class UserTokens:
    """Verifies user tokens (module docstring)."""

    key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
    algorithm: str
    issuer: str
    audience: str
    max_lifetime_s: float
    # sha256 of a verified token -> (its user, its expiry): verifying costs 0.1-0.3 ms of CPU, a lookup nothing.
    _verified: OrderedDict[bytes, tuple[str, float]] = field(default_factory=OrderedDict, repr=False, compare=False)
    _verified_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def from_file(cls, path: Path, issuer: str, audience: str, max_lifetime_s: float) -> UserTokens:
        """ConfigError naming the option for an unreadable key, a key of another kind, or a missing issuer."""
        try:
            key = load_pem_public_key(Path(path).read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--user-token-public-key-file {path}: not a PEM public key ({exc})") from exc
        if isinstance(key, rsa.RSAPublicKey):
            algorithm = "RS256"
        elif isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
            algorithm = "ES256"
        elif isinstance(key, ed25519.Ed25519PublicKey):
            algorithm = "EdDSA"
        else:
            raise ConfigError(f"--user-token-public-key-file {path}: an RSA, P-256 or Ed25519 public key")
        if not issuer:
            raise ConfigError("--user-token-issuer: required with --user-token-public-key-file (the gateway's `iss`)")
        if not audience:
            raise ConfigError("--user-token-audience: must not be empty")
        if max_lifetime_s <= 0:
            raise ConfigError("--user-token-max-lifetime-s: must be positive")
        return cls(key, algorithm, issuer, audience, max_lifetime_s)

    def user_of(self, token: str) -> str:
        """The user a valid token names; PermissionDenied (naming `user_token`) for any other token."""
        if not token:
            raise PermissionDenied(f"{TOKEN_FIELD}: this service serves a node only the user named by the user token "
                                   "the gateway minted for the request; none was sent")
        if len(token) > MAX_TOKEN_CHARS:
            raise PermissionDenied(f"{TOKEN_FIELD}: longer than {MAX_TOKEN_CHARS} characters")
        digest = hashlib.sha256(token.encode()).digest()
        with self._verified_lock:
            known = self._verified.get(digest)
            if known is not None and time.time() <= known[1] + CLOCK_SKEW_S:
                self._verified.move_to_end(digest)
                return known[0]
        subject, expires = self._verify(token)
        with self._verified_lock:
            self._verified[digest] = (subject, expires)
            while len(self._verified) > VERIFIED_TOKENS_KEPT:
                self._verified.popitem(last=False)
        return subject

    def _verify(self, token: str) -> tuple[str, float]:
        """The user and expiry of a valid token; PermissionDenied otherwise."""
        try:
            claims = jwt.decode(token, self.key, algorithms=[self.algorithm], audience=self.audience,
                                issuer=self.issuer, leeway=CLOCK_SKEW_S,
                                options={"require": ["sub", "iat", "exp", "iss", "aud"], "strict_aud": True})
        except jwt.PyJWTError as exc:
            raise PermissionDenied(f"{TOKEN_FIELD}: not a valid user token ({str(exc)[:200]})") from None
        subject, issued, expires = claims["sub"], claims["iat"], claims["exp"]
        if not isinstance(subject, str) or not subject:
            raise PermissionDenied(f"{TOKEN_FIELD}: `sub` must name a user")
        if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in (issued, expires)):
            raise PermissionDenied(f"{TOKEN_FIELD}: `iat` and `exp` must be numbers")
        if expires - issued > self.max_lifetime_s:
            raise PermissionDenied(f"{TOKEN_FIELD}: lives {expires - issued:.0f} s, longer than this service "
                                   f"accepts ({self.max_lifetime_s:.0f} s, --user-token-max-lifetime-s)")
        return subject, float(expires)

    def authorize(self, role: str, method: str, user_id: str, token: str) -> None:
        """PermissionDenied unless a caller of `role` calling `method` for `user_id` holds a valid token naming that
        user (only node reads are bound to a user token)."""
        if role not in USER_BOUND_ROLES or method not in USER_BOUND_METHODS:
            return
        named = self.user_of(token)
        if named != user_id:
            raise PermissionDenied(f"{TOKEN_FIELD}: names another user than user_id {user_id[:128]!r}")
