"""Kafka clients over TLS and SASL: settings become the options of aiokafka and FastStream."""

from __future__ import annotations

import ssl

import pytest
from aiokafka import AIOKafkaProducer
from faststream.security import SASLScram512

from budgetgate.kafka_access import PLAINTEXT, KafkaAccess
from budgetgate.settings import CommonSettings


def test_plaintext_adds_nothing() -> None:
    assert PLAINTEXT.aiokafka() == {} and PLAINTEXT.faststream() is None


def test_settings_become_sasl_over_tls_without_showing_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"SECURITY_PROTOCOL": "SASL_SSL", "SASL_MECHANISM": "SCRAM-SHA-512", "SASL_USERNAME": "admission", "SASL_PASSWORD": "pw-123"}.items():
        monkeypatch.setenv(f"BUDGETGATE_KAFKA_{name}", value)
    settings = CommonSettings()
    access = settings.kafka_access
    assert "pw-123" not in repr(settings) and "pw-123" not in repr(access)
    options = access.aiokafka()
    assert {k: options[k] for k in ("security_protocol", "sasl_mechanism", "sasl_plain_username", "sasl_plain_password")} == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "admission", "sasl_plain_password": "pw-123",
    }  # fmt: skip
    assert isinstance(options["ssl_context"], ssl.SSLContext)
    assert isinstance(access.faststream(), SASLScram512)


async def test_aiokafka_accepts_the_options() -> None:
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", **KafkaAccess("SASL_PLAINTEXT", "PLAIN", "u", "p").aiokafka())
    assert producer.client._security_protocol == "SASL_PLAINTEXT"  # noqa: SLF001 - what the client will speak
    await producer.stop()


def test_sasl_without_credentials_is_refused() -> None:
    with pytest.raises(ValueError, match="SASL_MECHANISM"):
        KafkaAccess("SASL_SSL")
