"""What a server operator sees (the real server): the periodic stats line and its off switch, request
lines with --enable-log-requests, a clean exit (0, no traceback) on SIGINT and on SIGTERM, and TLS
(--ssl-keyfile / --ssl-certfile) behind a proxy path (--root-path)."""

from __future__ import annotations

import re
import signal
import ssl
import time

import httpx
import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import Server, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


def serve_once(folder: str, stop: signal.Signals, *flags: str) -> tuple[int, str]:
    server = Server(folder, *flags)
    server.wait_ready()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=60)
    assert r.status_code == 200
    time.sleep(1.5)  # three stats intervals
    server.proc.send_signal(stop)
    out, _ = server.proc.communicate(timeout=60)
    return server.proc.returncode, out


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_stats_request_lines_and_a_clean_exit(folder, monkeypatch, stop):
    monkeypatch.setenv("TOKENOS_LOG_STATS_INTERVAL_S", "0.5")
    code, out = serve_once(folder, stop, "--enable-log-requests")
    assert code == 0 and "Traceback" not in out, out[-3000:]
    assert "Received request cmpl-" in out and f"{stop.name} received" in out
    busy = re.findall(
        r"Avg generation throughput: ([0-9.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs", out
    )
    assert any(float(rate) > 0 for rate in busy), out[-3000:]


def test_disable_log_stats(folder, monkeypatch):
    monkeypatch.setenv("TOKENOS_LOG_STATS_INTERVAL_S", "0.5")
    code, out = serve_once(folder, signal.SIGINT, "--disable-log-stats")
    assert code == 0 and "Avg prompt throughput" not in out and "Received request" not in out


def self_signed(folder) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1 (the certificate is its own CA)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = str(folder / "key.pem"), str(folder / "cert.pem")
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def test_tls_and_root_path(folder, tmp_path):
    pytest.importorskip("cryptography")
    key, cert = self_signed(tmp_path)
    flags = ("--ssl-keyfile", key, "--ssl-certfile", cert, "--root-path", "/api", "--enable-docs")
    with running_server(folder, *flags) as server:
        assert server.url.startswith("https://")
        trust = ssl.create_default_context(cafile=cert)  # the handshake checks the certificate
        models = httpx.get(f"{server.url}/v1/models", verify=trust, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        assert {"url": "/api"} in httpx.get(f"{server.url}/openapi.json", verify=trust).json()["servers"]
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https", "http") + "/health", timeout=5)  # no plain HTTP
