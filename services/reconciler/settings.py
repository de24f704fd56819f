"""Settings of the reconciler (BUDGETGATE_ variables)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import Field, model_validator

from budgetgate.core.reconciliation import Rules
from budgetgate.edge.auth import AuthSettings


class ReconcilerSettings(AuthSettings):
    service_name: str = "budgetgate-reconciler"
    # /healthz, /readyz, /metrics and the operator's dead-letter routes are served here.
    host: str = "127.0.0.1"
    port: int = 9464
    consumer_group: str = "budgetgate-reconciler"
    # Records one poll hands to one transaction.
    consumer_max_records: int = 500
    pg_pool_min: int = 2
    pg_pool_max: int = 10
    # A run admitted but not running (never started, or evicted and not re-admitted) for this
    # long gives its reservation back.
    start_deadline_seconds: float = 3600.0
    # A run the Kubernetes validating webhook admitted holds provisionally: unless the platform
    # confirms its object was stored (a STORED event from the lifecycle controller, any start,
    # eviction or end, or a usage sample) this long after admission, its reservation is given back
    # ("the object was never stored": a later webhook, a ResourceQuota or a taken name refused it).
    provisional_hold_seconds: float = Field(default=120.0, gt=0)
    # A finished run whose metering has not caught up is charged provisionally (bound GPUs ×
    # wall time) after this long, and corrected when the samples arrive.
    provisional_grace_seconds: float = 600.0
    # A sample this close before a run stopped counts as its final reading.
    metering_tolerance_seconds: float = 60.0
    # How often a running run's wall time is charged anew when a wall-hours budget covers it.
    wall_refresh_seconds: float = 60.0
    # How often time-driven work runs: due runs, rolling windows, holds.
    tick_seconds: float = 2.0
    # A Redis hold whose decision never reached Postgres is released after this long.
    orphan_grace_seconds: float = 120.0
    # Escrow leases (budgets that roots share, budgetgate.ledger.escrow_leases) whose size has
    # not moved for this long give back what their roots do not use beyond a chunk, every
    # orphan sweep (half of orphan_grace_seconds).
    escrow_idle_seconds: float = Field(default=300.0, gt=0)
    # How often Redis is compared with Postgres (the drift check, a metric); 0 turns it off.
    drift_check_seconds: float = 15.0
    # Runs settled at once (each in its own transaction; keep below pg_pool_max).
    settle_concurrency: int = 8
    # A run whose settlement fails this many times for a reason other than an outage is
    # dead-lettered (settlement_failures) instead of being tried for ever.
    settle_tries: int = 3
    # Fair share weighs past GPU usage 2^(-age / half-life) (Slurm's PriorityDecayHalfLife); the
    # same variable as admission's, which reads the decayed usage this keeps.
    fair_share_half_life_seconds: float = Field(default=7 * 86400.0, gt=0)
    # A run refused (DELAY, quota rejection) longer ago than this gets no more HEADROOM actions.
    waiting_seconds: float = Field(default=7 * 86400.0, gt=0)
    # The Kubernetes objects the webhook admitted (whose children pass on them) are forgotten
    # this long after their run ended (settled or released, not running); never before it ends.
    admitted_objects_retention_seconds: float = Field(default=7 * 86400.0, gt=0)
    # The older name of BUDGETGATE_PORT, from when the reconciler served only metrics: still read,
    # BUDGETGATE_PORT (or --port) winning when both are set.
    metrics_port: int | None = None
    # The older name of BUDGETGATE_HOST: still read, BUDGETGATE_HOST (or --host) winning when both are set.
    metrics_host: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _older_names(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for older, name in (("metrics_port", "port"), ("metrics_host", "host")):
                if values.get(older) is not None and values.get(name) is None:
                    values = {**values, name: values[older]}
        return values

    def rules(self) -> Rules:
        return Rules(
            start_deadline=timedelta(seconds=self.start_deadline_seconds),
            provisional_grace=timedelta(seconds=self.provisional_grace_seconds),
            metering_tolerance=timedelta(seconds=self.metering_tolerance_seconds),
            wall_refresh=timedelta(seconds=self.wall_refresh_seconds),
            provisional_hold=timedelta(seconds=self.provisional_hold_seconds),
        )
