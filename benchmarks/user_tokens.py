"""What user-bound node access costs the memory service per call: verifying a gateway's user token (a JWT) the first
time a token is seen, and finding it verified afterwards (the calls and fetches of one request carry one token), for
each key type the service takes. `python -m benchmarks.user_tokens [--tokens N] [--repeats R]`."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from memory_service.user_tokens import UserTokens

KEYS = {"RS256 (RSA-2048)": (lambda: rsa.generate_private_key(65537, 2048), "RS256"),
        "ES256 (P-256)": (lambda: ec.generate_private_key(ec.SECP256R1()), "ES256"),
        "EdDSA (Ed25519)": (ed25519.Ed25519PrivateKey.generate, "EdDSA")}


def measure(make_key, algorithm: str, tokens: int, repeats: int) -> tuple[float, float]:
    """Microseconds per check: a token's first, and one already verified."""
    key = make_key()
    path = Path(tempfile.mkdtemp()) / "gateway.pem"
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    verifier = UserTokens.from_file(path, "gateway", "inferscale-memory", 300)
    now = int(time.time())
    minted = [jwt.encode({"sub": f"user-{index}", "iss": "gateway", "aud": "inferscale-memory", "iat": now,
                          "exp": now + 300}, key, algorithm=algorithm) for index in range(tokens)]
    started = time.perf_counter()
    for token in minted:
        verifier.user_of(token)
    first = (time.perf_counter() - started) / tokens
    started = time.perf_counter()
    for _ in range(repeats):
        for token in minted:
            verifier.user_of(token)
    again = (time.perf_counter() - started) / (tokens * repeats)
    return first * 1e6, again * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1000, help="distinct tokens per key type")
    parser.add_argument("--repeats", type=int, default=10, help="checks of each token after its first")
    args = parser.parse_args(argv)
    print("| key | first check of a token (µs) | a verified token again (µs) |\n|---|---:|---:|")
    for name, (make_key, algorithm) in KEYS.items():
        first, again = measure(make_key, algorithm, args.tokens, args.repeats)
        print(f"| {name} | {first:.0f} | {again:.1f} |")


if __name__ == "__main__":
    main()
