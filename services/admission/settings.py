"""Settings of the admission service (BUDGETGATE_ variables)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from budgetgate.edge.auth import AuthSettings


class AdmissionSettings(AuthSettings):
    service_name: str = "budgetgate-admission"
    host: str = "127.0.0.1"
    port: int = 8080
    pg_pool_min: int = 2
    pg_pool_max: int = 20
    # What a submission that no budget covers gets: allowed (and recorded), or rejected.
    unmatched: Literal["allow", "deny"] = "allow"
    policy_refresh_seconds: float = 5.0
    # The label whose value names the user a run was submitted for (usage by user).
    user_label: str = "user"
    max_body_bytes: int = 64 * 1024
    # A Redis hold older than this whose decision is not in Postgres is an orphan of a process
    # that died between reserving and committing, and is released.
    orphan_grace_seconds: float = 120.0
    # Fair share weighs past GPU usage 2^(-age / half-life), like Slurm's PriorityDecayHalfLife
    # (the reconciler's BUDGETGATE_FAIR_SHARE_HALF_LIFE_SECONDS; the same variable).
    fair_share_half_life_seconds: float = Field(default=7 * 86400.0, gt=0)
    # A run admitted but not started for this long gives its reservation back (the reconciler's
    # BUDGETGATE_START_DEADLINE_SECONDS; the same variable): a DELAY counts on that release.
    start_deadline_seconds: float = 3600.0
    # Group commit: a batch takes up to `batch_max` submissions, waits at most
    # `batch_wait_seconds` to fill while another batch is in flight and submissions are arriving
    # closer together than that (else it starts at once), and up to `batches_in_flight` batches
    # run at once.
    batch_max: int = 64
    batch_wait_seconds: float = 0.001
    batches_in_flight: int = 2
    # One submission is timed stage by stage (budgetgate_admission_stage_seconds) whenever this
    # many seconds have passed since the last one timed; 0 times every submission. A histogram
    # record costs more CPU than most stages take (nine records were 10 % of the service's CPU
    # when every submission was timed): at the default at most 50 a second are timed.
    stage_timing_interval_seconds: float = Field(default=0.02, ge=0)
    # The outbox relay is woken this long after a batch of decisions committed, once for all the
    # batches committed meanwhile (0: at once, a relay pass per batch).
    relay_linger_seconds: float = Field(default=0.05, ge=0)
    # While another instance rebuilds the Redis ledger from Postgres (Redis restored from an
    # older snapshot, or emptied), a submission waits this long for it, then gets a 503.
    rebuild_wait_seconds: float = Field(default=5.0, gt=0)
    # An external accounting system's remaining budget per tenant (Waldur-style
    # `remaining_budget`, in GPU-hours), at a URL holding {tenant}: used for the tenant's soft
    # GPU-hour budget when it answers within the timeout; unset, or failing, the ledger's figure.
    accounting_url: str | None = None
    accounting_token: SecretStr | None = None
    accounting_timeout_seconds: float = Field(default=0.25, gt=0, le=10)
    accounting_cache_seconds: float = Field(default=30.0, ge=0)
    # The circuit breaker opens after this many failures in a row and tries again after reset.
    accounting_failure_threshold: int = Field(default=5, ge=1)
    accounting_reset_seconds: float = Field(default=30.0, gt=0)
