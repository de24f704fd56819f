"""How every budgetgate Kafka client reaches the brokers: plaintext (the local stack), TLS, or
SASL (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) with or without TLS. One value, built from the
BUDGETGATE_KAFKA_* settings, turned into the options of aiokafka and of FastStream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal

Protocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
Mechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


@dataclass(frozen=True)
class KafkaAccess:
    security_protocol: Protocol = "PLAINTEXT"
    sasl_mechanism: Mechanism | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None

    def __post_init__(self) -> None:
        if self.security_protocol.startswith("SASL") and not (self.sasl_mechanism and self.sasl_username and self.sasl_password):
            raise ValueError(f"BUDGETGATE_KAFKA_SECURITY_PROTOCOL={self.security_protocol} needs BUDGETGATE_KAFKA_SASL_MECHANISM, _USERNAME and _PASSWORD")

    @property
    def tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def _ssl_context(self) -> Any:
        from aiokafka.helpers import create_ssl_context

        return create_ssl_context(cafile=self.ssl_cafile) if self.tls else None

    def aiokafka(self) -> dict[str, Any]:
        """Keyword arguments for an aiokafka producer, consumer or admin client."""
        if self.security_protocol == "PLAINTEXT":
            return {}
        options: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.tls:
            options["ssl_context"] = self._ssl_context()
        if self.sasl_mechanism:
            options |= {"sasl_mechanism": self.sasl_mechanism, "sasl_plain_username": self.sasl_username, "sasl_plain_password": self.sasl_password}
        return options

    def faststream(self) -> Any:
        """The `security` of a FastStream KafkaBroker (None for plaintext)."""
        from faststream.security import BaseSecurity, SASLPlaintext, SASLScram256, SASLScram512

        if self.security_protocol == "PLAINTEXT":
            return None
        if not self.sasl_mechanism:
            return BaseSecurity(ssl_context=self._ssl_context(), use_ssl=True)
        kind = {"PLAIN": SASLPlaintext, "SCRAM-SHA-256": SASLScram256, "SCRAM-SHA-512": SASLScram512}[self.sasl_mechanism]
        return kind(username=self.sasl_username or "", password=self.sasl_password or "", ssl_context=self._ssl_context(), use_ssl=self.tls)


PLAINTEXT = KafkaAccess()


async def start_whole(start: Awaitable[Any], *, grace: float = 10.0) -> None:
    """Await a Kafka client's start (aiokafka's or a FastStream broker's) without cutting it off
    mid-way. aiokafka's bootstrap closes its connection to the broker only on a Kafka error or a
    timeout: cancelled while it waits for the broker's metadata, it leaves that socket open for
    good (a service stopped while Kafka is slow to answer). So a caller cancelled here lets the
    start finish, for up to `grace` seconds, before its cancellation goes on; it then stops the
    client as after any failed start."""
    task = asyncio.ensure_future(start)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, grace)
        raise
