"""When the client sends a request again: only when the service could not have acted on it
(a connection that failed) or said it cannot decide now (503). Every resend is the same request,
so a submission keeps its run id and attempt and is decided once (the server replays it)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx
from tenacity import AsyncRetrying, RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt, stop_after_delay

from budgetgate.client.errors import Unavailable

# Connection errors, not timeouts reading an answer: a request that timed out may still be
# deciding, and its caller should learn that rather than wait through resends.
RETRYABLE: tuple[type[BaseException], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    Unavailable,
)


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` sends within `deadline` seconds, waiting from `initial` doubling to
    `max_wait` (with jitter), or longer when a 503 says Retry-After."""

    attempts: int = 5
    initial: float = 0.2
    max_wait: float = 5.0
    deadline: float = 30.0

    def _kwargs(self) -> dict[str, object]:
        def wait(state: RetryCallState) -> float:
            # Exponential with full jitter on top, so many clients refused at once spread out.
            backoff = min(self.max_wait, self.initial * 2 ** (state.attempt_number - 1)) + random.uniform(0, self.initial)
            error = state.outcome.exception() if state.outcome else None
            asked = getattr(error, "retry_after", None) or 0.0
            return min(max(backoff, asked), self.max_wait)

        return {
            "retry": retry_if_exception_type(RETRYABLE),
            "stop": stop_after_attempt(self.attempts) | stop_after_delay(self.deadline),
            "wait": wait,
            "reraise": True,
        }

    def sync(self) -> Retrying:
        return Retrying(**self._kwargs())  # type: ignore[arg-type]

    def asynchronous(self) -> AsyncRetrying:
        return AsyncRetrying(**self._kwargs())  # type: ignore[arg-type]


NO_RETRY = RetryPolicy(attempts=1)
