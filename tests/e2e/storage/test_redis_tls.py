"""The redis backend over TLS (``rediss://``) to a redis-server with a throwaway certificate."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache.config import MemLayout
from hicache.net import free_port
from hicache.storage.backends.redis.backend import RedisBackend
from hicache.storage.base import StorageBackend, StorageUnavailableError
from hicache.testing.redis_server import RedisServerProcess, start_redis_server
from tests.dev_dependency import require_program
from tests.redis_fixtures import fresh_prefix
from tests.storage_contract import StorageContract

OPENSSL = require_program("openssl", "apt-get install openssl")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


@pytest.fixture(scope="module")
def tls_server(certificate: tuple[Path, Path]) -> Iterator[tuple[RedisServerProcess, int]]:
    """A redis-server that also speaks TLS on a port of its own (clients need no certificate)."""
    cert, key = certificate
    tls_port = free_port()
    with start_redis_server(extra_args=(
        "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
    )) as server:
        yield server, tls_port


class TestRedisContractOverTls(StorageContract):
    @pytest.fixture
    def store(
        self, tls_server: tuple[RedisServerProcess, int], certificate: tuple[Path, Path]
    ) -> Any:
        _, tls_port = tls_server
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={certificate[0]}"
        return {"url": url, "prefix": fresh_prefix()}

    def make_backend(self, store: Any) -> StorageBackend:
        return RedisBackend(store)


def test_a_certificate_the_client_does_not_trust_fails_attach(
    tls_server: tuple[RedisServerProcess, int],
) -> None:
    _, tls_port = tls_server
    backend = RedisBackend({"url": f"rediss://127.0.0.1:{tls_port}/0"})  # system CAs only
    host = StorageContract().make_host(MemLayout.PAGE_FIRST)
    with pytest.raises(StorageUnavailableError, match="cannot be reached"):
        backend.attach(host)
    backend.close()

