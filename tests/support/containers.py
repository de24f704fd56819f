"""Postgres, Redis and Kafka in containers, used only when a Docker engine answers.

testcontainers (and the docker SDK under it) is imported here and only here, lazily, so a run
without Docker never pays for it and never sees its import-time warnings.
"""

from __future__ import annotations

import os
import socket
import warnings
from contextlib import ExitStack
from functools import cache
from typing import Any


@cache
def docker_engine_available() -> bool:
    """True when a Docker engine answers GET /_ping (a docker client alone is not enough).

    Asked over a plain socket rather than through the docker SDK, which leaves its socket open
    when the engine is absent (a ResourceWarning, and warnings are errors in this suite).
    """
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(3)
            with sock:
                sock.connect(host.removeprefix("unix://"))
                return _pinged(sock)
        if host.startswith("tcp://"):
            address, _, port = host.removeprefix("tcp://").rstrip("/").rpartition(":")
            with socket.create_connection((address, int(port)), timeout=3) as sock:
                return _pinged(sock)
    except (OSError, ValueError):
        return False
    return False  # ssh:// and the like: not worth guessing


def _pinged(sock: socket.socket) -> bool:
    sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
    status_line = sock.recv(128).split(b"\r\n", 1)[0]
    return status_line.startswith(b"HTTP/1.") and b" 200" in status_line


def _enter(stack: ExitStack, container: Any) -> Any:
    # testcontainers emits deprecation warnings of its own; they are not this project's to fix.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return stack.enter_context(container)


def postgres(stack: ExitStack) -> str:
    from testcontainers.community.postgres import PostgresContainer

    container = _enter(stack, PostgresContainer("postgres:16-alpine", username="postgres", password="postgres", dbname="postgres", driver=None))
    return str(container.get_connection_url())


def redis(stack: ExitStack) -> str:
    from testcontainers.community.redis import RedisContainer

    container = _enter(stack, RedisContainer("redis:7-alpine"))
    return f"redis://{container.get_container_host_ip()}:{container.get_exposed_port(6379)}/0"


def kafka(stack: ExitStack) -> str:
    from testcontainers.community.kafka import KafkaContainer

    container = _enter(stack, KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft())
    return str(container.get_bootstrap_server())
