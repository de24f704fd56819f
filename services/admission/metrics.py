"""The admission service's metrics: its answers (counted and timed as they go out), where a
submission's time goes stage by stage (`budgetgate_admission_stage_seconds`, see stages.py), the
reservations held and Redis rebuilds, and per budget of the active bundle in its current window
(`budgetgate_budget_committed_ratio`, `budgetgate_budget_consumed_ratio`, `budgetgate_budget_remaining`, `budgetgate_budget_held`), read
from the running service's `BudgetBoard`, refreshed periodically from Postgres so a scrape costs
no query."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import asyncpg
from opentelemetry.metrics import Counter, Histogram, Meter, Observation

from budgetgate.policies.policy_store import PolicyStore
from budgetgate.reports.budgets import list_budgets
from budgetgate.services.admission.stages import STAGES, StageClock, StageSampler

if TYPE_CHECKING:
    from budgetgate.services.admission.service import AdmissionService

log = logging.getLogger(__name__)

REFRESH_SECONDS = 15.0
# Seconds, fine enough below a millisecond for a stage's p50 and p99 to be read off the buckets.
STAGE_BUCKETS = (
    0.000025, 0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003,
    0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
_STAGE_ATTRIBUTES = {stage: {"stage": stage} for stage in STAGES}
_DECISION_ATTRIBUTES = {decision: {"decision": decision} for decision in ("ALLOW", "DENY", "DELAY")}


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
    # Answers by (decision, replayed), read by an observable counter when scraped: a synchronous
    # counter's add cost about 10 µs of every answer, a tally's increment a fraction of one.
    answered: Tally[tuple[str, str]]
    latency: Histogram
    quotes: Counter
    stages: Histogram
    sampler: StageSampler

    @classmethod
    def create(cls, meter: Meter, running: Callable[[], AdmissionService | None], *, stage_interval: float = 0.0) -> Metrics:
        """The service's instruments; the gauges read the running service (`running()`, None
        while it is not) when scraped. A submission is timed stage by stage whenever
        `stage_interval` seconds have passed since the last one timed (stages.StageSampler)."""

        def reading(read: Callable[[AdmissionService], float]) -> Callable[[Any], list[Observation]]:
            return lambda _options: [Observation(read(rt) if (rt := running()) is not None else 0)]

        meter.create_observable_gauge(
            "budgetgate_reservations_held", callbacks=[reading(lambda rt: rt.held)], description="reservations held by admitted runs not yet reconciled"
        )
        meter.create_observable_counter(
            "budgetgate_redis_rebuilds",
            callbacks=[reading(lambda rt: rt.ledgers.rebuilds)],
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
        answered: Tally[tuple[str, str]] = Tally()
        meter.create_observable_counter(
            "budgetgate_admission_decisions",
            callbacks=[lambda _options: [Observation(n, {"decision": decision, "replayed": replayed}) for (decision, replayed), n in answered.items()]],
            description="admission answers by decision",
        )
        return cls(
            answered=answered,
            latency=meter.create_histogram("budgetgate_admission_latency", unit="s", description="time to answer a submission"),
            quotes=meter.create_counter("budgetgate_admission_quotes", description="quotes answered, by the decision quoted (never decisions)"),
            stages=meter.create_histogram(
                "budgetgate_admission_stage", unit="s", explicit_bucket_boundaries_advisory=STAGE_BUCKETS,
                description="a timed submission's seconds in each stage of POST /v1/admissions, by stage (they add up to its time in the service)",
            ),
            sampler=StageSampler(stage_interval),
        )  # fmt: skip

    def observe(self, answer: dict[str, Any], seconds: float) -> None:
        decision = answer["decision"]
        self.answered[decision, "true" if answer["replayed"] else "false"] += 1
        self.latency.record(seconds, _DECISION_ATTRIBUTES.get(decision) or {"decision": decision})

    def stage_clock(self, now: float) -> StageClock | None:
        """A clock for a submission received at `now`, if it is one to time."""
        return self.sampler.clock(now)

    def observe_stages(self, clock: StageClock, answered: float) -> None:
        """Record the stages of a timed submission answered at `answered` (nothing if it never
        reached a batch)."""
        stages = clock.stages(answered)
        if stages is None:
            return
        for stage, seconds in stages.items():
            self.stages.record(seconds, _STAGE_ATTRIBUTES[stage])

    def observe_quote(self, answer: dict[str, Any], _seconds: float) -> None:
        self.quotes.add(1, {"decision": answer["decision"]})
