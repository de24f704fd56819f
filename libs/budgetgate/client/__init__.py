"""A typed Python client of budgetgate, sync (Client) and async (AsyncClient), answering with the
admission API's own pydantic models; lifecycle events and metering samples go to Kafka
(KafkaFeed) or over HTTP to metering-ingest (publish_*).

Requests that fail to connect, or that a service answers 503 or 429, are sent again unchanged
(a submission keeps its run id and attempt, so it is decided once), never sooner than a
Retry-After asks. The bearer token comes from the `token` argument, else BUDGETGATE_TOKEN.
"""

from budgetgate.client.aio import AsyncClient
from budgetgate.client.endpoints import NoEndpoint
from budgetgate.client.errors import Archived, BudgetgateError, Conflict, InvalidRequest, NotFound, NotGranted, RateLimited, Unauthorized, Unavailable
from budgetgate.client.feeds import KafkaFeed, lifecycle_event, metering_sample
from budgetgate.client.retries import NO_RETRY, RetryPolicy
from budgetgate.client.sync import Client

__all__ = [
    "NO_RETRY",
    "Archived",
    "AsyncClient",
    "BudgetgateError",
    "Client",
    "Conflict",
    "InvalidRequest",
    "KafkaFeed",
    "NoEndpoint",
    "NotFound",
    "NotGranted",
    "RateLimited",
    "RetryPolicy",
    "Unauthorized",
    "Unavailable",
    "lifecycle_event",
    "metering_sample",
]
