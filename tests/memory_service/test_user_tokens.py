"""User-bound node access: a memory service started with --user-token-public-key-file serves a node credential only
the user a valid gateway token of that very call names. Unit checks of the token rules, then a real service.

Regression (issue 43, the table's fourth row): a node credential called RetrieveAndStage / FetchKv for any user of
any tenant and got that user's fact text and KV."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.profile import kv_profile_id
from memory_service.access import ROLE_METHODS
from memory_service.config import ConfigError
from memory_service.errors import PermissionDenied
from memory_service.user_tokens import CLOCK_SKEW_S, USER_BOUND_METHODS, UserTokens
from tests.conftest import own_memory_service
from tests.memory_service.test_access import CREDENTIALS, _metadata, _write

ISSUER = "https://gateway.example"
AUDIENCE = "inferscale-memory"
GATEWAY_KEY = ed25519.Ed25519PrivateKey.generate()
OTHER_KEY = ed25519.Ed25519PrivateKey.generate()


def _public_pem(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def mint(user_id: str, key=GATEWAY_KEY, lifetime_s: float = 300, issued_ago_s: float = 0, algorithm: str = "EdDSA",
         **claims) -> str:
    """A user token as the gateway mints it (claims overridable)."""
    now = time.time() - issued_ago_s
    body = {"sub": user_id, "iss": ISSUER, "aud": AUDIENCE, "iat": int(now), "exp": int(now + lifetime_s), **claims}
    return jwt.encode({name: value for name, value in body.items() if value is not None}, key, algorithm=algorithm)


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> UserTokens:
    path = tmp_path_factory.mktemp("gateway") / "gateway.pem"
    path.write_bytes(_public_pem(GATEWAY_KEY))
    return UserTokens.from_file(path, ISSUER, AUDIENCE, 900)


def test_a_valid_token_names_its_user(verifier):
    assert verifier.user_of(mint("acme/maya")) == "acme/maya"


@pytest.mark.parametrize("token", [
    "", "not-a-jwt", mint("acme/maya", key=OTHER_KEY), mint("acme/maya", issued_ago_s=400),
    mint("acme/maya", iss="https://evil.example"), mint("acme/maya", aud="another-service"),
    mint("acme/maya", lifetime_s=3600), mint("acme/maya", issued_ago_s=-600, lifetime_s=60),
    mint("acme/maya", exp=None), mint("acme/maya", iat=None), mint("acme/maya", sub=None),
    mint("acme/maya", aud=[AUDIENCE, "another-service"]), "x" * 9000,
    jwt.encode({"sub": "acme/maya", "iss": ISSUER, "aud": AUDIENCE, "iat": int(time.time()),
                "exp": int(time.time()) + 60}, None, algorithm="none"),
    # The public key as an HMAC secret (algorithm confusion): the algorithm is the key's, never the token's.
    jwt.encode({"sub": "acme/maya", "iss": ISSUER, "aud": AUDIENCE, "iat": int(time.time()),
                "exp": int(time.time()) + 60}, b"x" * 32, algorithm="HS256"),
], ids=["empty", "garbage", "other-key", "expired", "issuer", "audience", "too-long", "future", "no-exp", "no-iat",
        "no-sub", "audience-list", "huge", "alg-none", "alg-hs256"])
def test_any_other_token_is_permission_denied_naming_the_field(verifier, token):
    with pytest.raises(PermissionDenied, match="^user_token: "):
        verifier.user_of(token)


def test_a_verified_token_is_remembered_until_it_expires(verifier, monkeypatch):
    token = mint("acme/maya", lifetime_s=60)
    assert verifier.user_of(token) == "acme/maya"
    monkeypatch.setattr(UserTokens, "_verify", lambda self, token: pytest.fail("verified again"))
    assert verifier.user_of(token) == "acme/maya"  # remembered: no second signature check
    later = time.time() + 60 + CLOCK_SKEW_S + 1
    monkeypatch.setattr(time, "time", lambda: later)
    with pytest.raises(pytest.fail.Exception):  # expired: checked again (and refused by then)
        verifier.user_of(token)


def test_every_node_rpc_that_names_a_user_is_bound_to_its_token():
    """A user-data RPC added to the node role later must be bound too (or named here on purpose)."""
    assert ROLE_METHODS["node"] - USER_BOUND_METHODS == {"RetrieveAndStageBatch", "AnnounceProfile"}


def test_only_node_reads_are_bound_to_a_user_token(verifier):
    maya = mint("acme/maya")
    verifier.authorize("node", "RetrieveAndStage", "acme/maya", maya)
    with pytest.raises(PermissionDenied, match="another user"):
        verifier.authorize("node", "FetchKv", "acme/lee", maya)
    verifier.authorize("app", "SearchFacts", "acme/lee", "")  # apps are bound by their user_prefix
    verifier.authorize("node", "AnnounceProfile", "", "")  # no user's data


@pytest.mark.parametrize("make_key,problem", [
    (lambda: ec.generate_private_key(ec.SECP384R1()), "an RSA, P-256 or Ed25519 public key"),
    (None, "not a PEM public key"),
])
def test_a_key_the_service_cannot_use_fails_the_start(tmp_path, make_key, problem):
    path = tmp_path / "gateway.pem"
    path.write_bytes(_public_pem(make_key()) if make_key else b"-----BEGIN PUBLIC KEY-----\nxx\n")
    with pytest.raises(ConfigError, match=problem):
        UserTokens.from_file(path, ISSUER, AUDIENCE, 900)


# ---------------------------------------------------------------------------------------------- a real service

def _profile() -> pb.KvProfile:
    profile = pb.KvProfile(model="m", model_hash="m", kv_dtype="float32", tokenizer_hash="t", header_hash="h",
                           recipe="chunked-rope-cwe", recipe_version=1)
    profile.profile_id = kv_profile_id(profile)
    return profile


@contextmanager
def user_bound_memory_service(tmp_path_factory, name: str) -> Iterator[MemoryServiceProcess]:
    """A memory service with access control (test_access's credentials) binding node reads to the gateway's user
    tokens, holding one fact of acme/maya and one of acme/lee."""
    root = tmp_path_factory.mktemp(name)
    (root / "gateway.pem").write_bytes(_public_pem(GATEWAY_KEY))
    with own_memory_service(tmp_path_factory, name, "--auth-file", str(_write(root, CREDENTIALS)),
                            "--user-token-public-key-file", str(root / "gateway.pem"),
                            "--user-token-issuer", ISSUER) as service:
        with service.channel() as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            for user_id, text in (("acme/maya", "Maya keeps bees."), ("acme/lee", "Lee's door code is 4711.")):
                stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[pb.FactInput(text=text)]),
                                 metadata=_metadata("acme-app"))
        yield service


def _retrieve(stub, user_id: str, token: str = "") -> pb.RetrieveAndStageResponse:
    return stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=user_id, query="what?", top_k=3,
                                                            profile=_profile(), node_id="n", user_token=token),
                                 metadata=_metadata("nodes"))


def test_a_node_credential_alone_reads_nothing(user_bound_service):
    with user_bound_service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        calls = [lambda: _retrieve(stub, "acme/lee"),
                 lambda: list(stub.FetchKv(pb.FetchKvRequest(profile_id=_profile().profile_id, user_id="acme/lee",
                                                             include_header=True, header_content_id="x"),
                                           metadata=_metadata("nodes")))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as error:
                call()
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert error.value.details().startswith("user_token: ")


def test_a_node_reads_only_the_user_its_call_token_names(user_bound_service):
    maya = mint("acme/maya")
    with user_bound_service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        assert [fact.text for fact in _retrieve(stub, "acme/maya", maya).facts] == ["Maya keeps bees."]
        with pytest.raises(grpc.RpcError) as error:
            _retrieve(stub, "acme/lee", maya)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED and "another user" in error.value.details()
        with pytest.raises(grpc.RpcError) as error:
            list(stub.FetchKv(pb.FetchKvRequest(profile_id=_profile().profile_id, user_id="acme/lee",
                                                user_token=maya), metadata=_metadata("nodes")))
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        batch = pb.RetrieveAndStageBatchRequest(calls=[
            pb.RetrieveAndStageRequest(user_id=user_id, query="what?", top_k=3, profile=_profile(), node_id="n",
                                       user_token=token)
            for user_id, token in (("acme/maya", maya), ("acme/lee", maya), ("acme/lee", ""))])
        results = stub.RetrieveAndStageBatch(batch, metadata=_metadata("nodes")).results
        assert [fact.text for fact in results[0].response.facts] == ["Maya keeps bees."]
        for refused in results[1:]:  # each call of a batch carries its own user's token
            assert refused.code == grpc.StatusCode.PERMISSION_DENIED.value[0] and not refused.response.facts
            assert refused.message.startswith("user_token: ")
        # An app reads its tenant's users as before: user tokens bind nodes only.
        listed = stub.ListFacts(pb.ListFactsRequest(user_id="acme/lee"), metadata=_metadata("acme-app"))
        assert [fact.text for fact in listed.facts] == ["Lee's door code is 4711."]


def test_user_tokens_need_access_control(tmp_path):
    (tmp_path / "gateway.pem").write_bytes(_public_pem(GATEWAY_KEY))
    process = MemoryServiceProcess(tmp_path / "data", tmp_path / "service.log", "--user-token-public-key-file",
                                   str(tmp_path / "gateway.pem"), "--user-token-issuer", ISSUER)
    with pytest.raises(RuntimeError, match="needs --auth-file"):
        process.start()
