"""The admission service's metrics: its answers (counted and timed as they go out), the
reservations held and Redis rebuilds, and per budget of the active bundle in its current window
(`budgetgate_budget_committed_ratio`, `budgetgate_budget_consumed_ratio`, `budgetgate_budget_remaining`, `budgetgate_budget_held`), read
from the running service's `BudgetBoard`, refreshed periodically from Postgres so a scrape costs
no query."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import asyncpg
from opentelemetry.metrics import Counter, Histogram, Meter, Observation

from budgetgate.policies.policy_store import PolicyStore
from budgetgate.reports.budgets import list_budgets

if TYPE_CHECKING:
    from budgetgate.services.admission.service import AdmissionService

log = logging.getLogger(__name__)

REFRESH_SECONDS = 15.0


class BudgetBoard:
    """The last reading of every budget, for the gauges; `refresh` reads Postgres once."""

    def __init__(self, pool: asyncpg.Pool, policies: PolicyStore) -> None:
        self.pool = pool
        self.policies = policies
        self.budgets: list[dict[str, Any]] = []

    async def refresh(self, now: datetime | None = None) -> None:
        bundle = self.policies.current
        self.budgets = [] if bundle is None else await list_budgets(self.pool, bundle, now or datetime.now(UTC))

    async def run(self, every: float = REFRESH_SECONDS) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the gauges keep their last reading until the next tick
                log.warning("budget gauges not refreshed: %s", exc)
            await asyncio.sleep(every)

    def observe(self, field: str) -> list[Observation]:
        observations = []
        for b in self.budgets:
            value = 1 if b["state"] == "held" else 0 if field == "held" else b[field]
            observations.append(Observation(value, {"policy_id": b["policy_id"], "scope_id": b["scope_id"], "unit": b["unit"]}))
        return observations


@dataclass(frozen=True)
class Metrics:
    decisions: Counter
    latency: Histogram
    quotes: Counter

    @classmethod
    def create(cls, meter: Meter, running: Callable[[], AdmissionService | None]) -> Metrics:
        """The service's instruments; the gauges read the running service (`running()`, None
        while it is not) when scraped."""

        def reading(read: Callable[[AdmissionService], float]) -> Callable[[Any], list[Observation]]:
            return lambda _options: [Observation(read(rt) if (rt := running()) is not None else 0)]

        meter.create_observable_gauge(
            "budgetgate_reservations_held", callbacks=[reading(lambda rt: rt.held)], description="reservations held by admitted runs not yet reconciled"
        )
        meter.create_observable_counter(
            "budgetgate_redis_rebuilds",
            callbacks=[reading(lambda rt: rt.sync.rebuilds)],
            description="rebuilds of the Redis ledger from Postgres this instance made (Redis emptied, restored from an older snapshot, or invalidated)",
        )
        for name, field, description in (
            ("budgetgate_budget_committed_ratio", "committed_ratio", "committed (reserved + consumed) / limit in the budget's current window"),
            ("budgetgate_budget_consumed_ratio", "consumed_ratio", "consumed (metered actuals) / limit in the budget's current window"),
            ("budgetgate_budget_remaining", "remaining", "what is left of the budget in its current window, in hours or its currency"),
            ("budgetgate_budget_held", "held", "1 while a hold is in force on the budget, else 0"),
        ):
            meter.create_observable_gauge(
                name, callbacks=[lambda _options, f=field: rt.board.observe(f) if (rt := running()) is not None else []], description=description
            )
        return cls(
            decisions=meter.create_counter("budgetgate_admission_decisions", description="admission answers by decision"),
            latency=meter.create_histogram("budgetgate_admission_latency", unit="s", description="time to answer a submission"),
            quotes=meter.create_counter("budgetgate_admission_quotes", description="quotes answered, by the decision quoted (never decisions)"),
        )

    def observe(self, answer: dict[str, Any], seconds: float) -> None:
        self.decisions.add(1, {"decision": answer["decision"], "replayed": "true" if answer["replayed"] else "false"})
        self.latency.record(seconds, {"decision": answer["decision"]})

    def observe_quote(self, answer: dict[str, Any], _seconds: float) -> None:
        self.quotes.add(1, {"decision": answer["decision"]})
