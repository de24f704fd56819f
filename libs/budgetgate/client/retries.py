"""When the client sends a request again: only when the service could not have acted on it
(a connection that failed), said it cannot decide now (503), or refused it for the caller's
rate (429). Every resend is the same request, so a submission keeps its run id and attempt and
is decided once (the server replays it).

A Retry-After is honoured whole: the next send is never sooner than the service asked, even
when that is longer than the policy's own backoff would wait. When the wait asked for would end
past the policy's deadline, the error is raised at once rather than the request sent early."""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx
from tenacity import AsyncRetrying, RetryCallState, Retrying, retry_if_exception_type

from budgetgate.client.errors import RateLimited, Unavailable

# Connection errors, not timeouts reading an answer: a request that timed out may still be
# deciding, and its caller should learn that rather than wait through resends.
RETRYABLE: tuple[type[BaseException], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    RateLimited,
    Unavailable,
)


def _asked(state: RetryCallState) -> float:
    """Seconds the last answer's Retry-After asked to wait (0 when it named none)."""
    error = state.outcome.exception() if state.outcome else None
    return float(getattr(error, "retry_after", None) or 0.0)


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` sends within `deadline` seconds, waiting from `initial` doubling to
    `max_wait` (with jitter) between them; a 429 or 503 that says Retry-After waits at least that
    long, past `max_wait` if need be, and is raised when that wait does not fit in the deadline."""

    attempts: int = 5
    initial: float = 0.2
    max_wait: float = 5.0
    deadline: float = 30.0

    def _wait(self, state: RetryCallState) -> float:
        # Exponential with full jitter on top, so many clients refused at once spread out.
        backoff = min(self.max_wait, self.initial * 2 ** (state.attempt_number - 1)) + random.uniform(0, self.initial)
        return max(backoff, _asked(state))

    def _stop(self, state: RetryCallState) -> bool:
        elapsed = state.seconds_since_start or 0.0
        return state.attempt_number >= self.attempts or elapsed >= self.deadline or elapsed + _asked(state) > self.deadline

    def _kwargs(self) -> dict[str, object]:
        return {"retry": retry_if_exception_type(RETRYABLE), "stop": self._stop, "wait": self._wait, "reraise": True}

    def sync(self) -> Retrying:
        return Retrying(**self._kwargs())  # type: ignore[arg-type]

    def asynchronous(self) -> AsyncRetrying:
        return AsyncRetrying(**self._kwargs())  # type: ignore[arg-type]


NO_RETRY = RetryPolicy(attempts=1)
