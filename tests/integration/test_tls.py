"""Every HTTP service serves HTTPS from a certificate and key setting, and listens on loopback
unless told otherwise."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from budgetgate.services.admission.settings import AdmissionSettings
from budgetgate.services.metering_ingest.settings import MeteringSettings
from tests.support.servers import free_port
from tests.support.waiting import wait_for


def self_signed(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_file, key_file


def test_services_listen_on_loopback_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BUDGETGATE_HOST", raising=False)
    assert AdmissionSettings().host == MeteringSettings().host == "127.0.0.1"


@pytest.mark.parametrize(("module", "method", "path"), [("admission", "GET", "/v1/budgets"), ("metering_ingest", "POST", "/v1/metering/samples")])
async def test_a_service_serves_https_from_its_certificate_and_key(module: str, method: str, path: str, settings, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    port = free_port()
    env = {
        **os.environ,
        "BUDGETGATE_POSTGRES_DSN": settings.postgres_dsn,
        "BUDGETGATE_REDIS_URL": settings.redis_url,
        "BUDGETGATE_REDIS_PREFIX": settings.redis_prefix,
        "BUDGETGATE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "BUDGETGATE_TOPIC_PREFIX": settings.topic_prefix,
        "BUDGETGATE_TLS_CERTFILE": str(cert), "BUDGETGATE_TLS_KEYFILE": str(key),
    }  # fmt: skip
    log = tmp_path / "service.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", f"budgetgate.services.{module}", "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(cert)), timeout=2) as client:

            async def answered() -> httpx.Response | None:
                try:
                    return await client.get(f"https://127.0.0.1:{port}/healthz")
                except httpx.TransportError:
                    assert proc.poll() is None, log.read_text()
                    return None

            answer = await wait_for(answered, timeout=30, what=f"an HTTPS answer (log: {log})")
            assert answer.status_code == 200
            assert (await client.request(method, f"https://127.0.0.1:{port}{path}")).status_code == 401
        with pytest.raises(httpx.TransportError):
            async with httpx.AsyncClient(timeout=2) as plain:
                await plain.get(f"http://127.0.0.1:{port}/healthz")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
