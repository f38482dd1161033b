"""Mutual TLS: a memory service with --tls-cert-file/--tls-key-file/--tls-client-ca-file admits only clients with a
certificate from its client CA, keeps plaintext health on --health-port for probes, and a worker configured through
its environment computes KV over it."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import WORKER, memory_service_channel
from tests.conftest import run_worker


def _issue(directory: Path, name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
           *, ca: bool = False) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for `name` (self-signed when `issuer` is None), written as NAME.crt and NAME.key."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_cert, issuer_key = issuer or (None, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer_cert.subject if issuer_cert else subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    certificate = builder.sign(issuer_key, hashes.SHA256())
    (directory / f"{name}.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return certificate, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    service_ca = _issue(directory, "service-ca", None, ca=True)
    client_ca = _issue(directory, "client-ca", None, ca=True)
    _issue(directory, "service", service_ca)
    _issue(directory, "worker", client_ca)
    _issue(directory, "stranger", _issue(directory, "other-ca", None, ca=True))
    return directory


@pytest.fixture(scope="module")
def tls_service(tmp_path_factory, pki) -> Iterator[MemoryServiceProcess]:
    root = tmp_path_factory.mktemp("tls")
    service = MemoryServiceProcess(
        root / "data", root / "service.log", "--tls-cert-file", str(pki / "service.crt"), "--tls-key-file",
        str(pki / "service.key"), "--tls-client-ca-file", str(pki / "client-ca.crt"), health_port=True).start()
    yield service
    service.stop()


def _as_worker(monkeypatch, pki: Path, client: str | None) -> None:
    monkeypatch.setenv(f"{WORKER}MEMORY_SERVICE_TLS_CA_FILE", str(pki / "service-ca.crt"))
    for setting, suffix in (("CERT", "crt"), ("KEY", "key")):
        if client:
            monkeypatch.setenv(f"{WORKER}MEMORY_SERVICE_TLS_{setting}_FILE", str(pki / f"{client}.{suffix}"))
        else:
            monkeypatch.delenv(f"{WORKER}MEMORY_SERVICE_TLS_{setting}_FILE", raising=False)


def test_a_client_with_a_certificate_from_the_client_ca_is_served(tls_service, pki, monkeypatch):
    _as_worker(monkeypatch, pki, "worker")
    with memory_service_channel(tls_service.address, WORKER) as channel:
        stats = memory_pb2_grpc.MemoryServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=30)
    assert stats.embedding_dim > 0


@pytest.mark.parametrize("client", [None, "stranger"])
def test_a_client_without_a_certificate_from_the_client_ca_is_refused(tls_service, pki, monkeypatch, client):
    _as_worker(monkeypatch, pki, client)
    with memory_service_channel(tls_service.address, WORKER) as channel, pytest.raises(grpc.RpcError) as error:
        memory_pb2_grpc.MemoryServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_is_refused_on_the_service_port_and_served_on_the_health_port(tls_service):
    with grpc.insecure_channel(tls_service.address) as channel, pytest.raises(grpc.RpcError):
        memory_pb2_grpc.MemoryServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    with grpc.insecure_channel(f"127.0.0.1:{tls_service.health_port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_a_worker_configured_for_mutual_tls_computes_kv(tls_service, pki, tiny_llama_dir, monkeypatch):
    _as_worker(monkeypatch, pki, "worker")
    with memory_service_channel(tls_service.address, WORKER) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        stub.IngestFacts(pb.IngestFactsRequest(user_id="tls-user", facts=[pb.FactInput(text="Tia flies kites.")]))
        run_worker(tls_service, tiny_llama_dir)
        (profile,) = stub.GetStats(pb.GetStatsRequest(user_id="tls-user")).profiles
    assert (profile.done, profile.failed) == (1, 0)


def test_the_python_client_speaks_mutual_tls(tls_service, pki):
    """The client package's TLS settings (clients/python): the service's CA and a client certificate."""
    from inferscale_client import InferScaleError, MemoryClient

    with MemoryClient(memory_service=tls_service.address, tls_ca_file=str(pki / "service-ca.crt"),
                      tls_cert_file=str(pki / "worker.crt"), tls_key_file=str(pki / "worker.key")) as client:
        client.add_facts("tls-client-user", ["Tom reads maps."])
        assert [fact.text for fact in client.list_facts("tls-client-user")] == ["Tom reads maps."]
    with MemoryClient(memory_service=tls_service.address, tls_ca_file=str(pki / "service-ca.crt"),
                      timeout_s=10) as client, pytest.raises(InferScaleError) as refused:
        client.stats()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
