"""Settings of the metering-ingest service (BUDGETGATE_ variables)."""

from __future__ import annotations

from datetime import timedelta

from pydantic import Field

from budgetgate.core.metering import DEFAULT_USAGE_TOLERANCE
from budgetgate.edge.auth import AuthSettings


class MeteringSettings(AuthSettings):
    service_name: str = "budgetgate-metering-ingest"
    host: str = "127.0.0.1"
    port: int = 8081
    pg_pool_min: int = 1
    pg_pool_max: int = 10
    # The Kafka consumer group, under the topic prefix as the other consumers' (`group_id`).
    consumer_group: str = "budgetgate-metering-ingest"
    # The name the samples' polls are recorded under (consumer_offsets: the offsets each poll
    # applied, per partition; a sample's id keeps it from being applied twice).
    inbox_name: str = "metering-ingest"
    # The most samples one poll takes, and so one Postgres transaction. A backlog drains in polls
    # this large (the broker's fetch sizes keep them to about 15,000 samples of the usual size):
    # each run's lock, row update and quarter-hour points are paid once per poll, so larger polls
    # cost less per sample (`budgetgate bench metering --samples 200000 --runs 2000`: 64 µs of CPU
    # per sample, all parts, at 15,000 against 75 at 5,000; WAL 127 bytes against 204). A steady
    # stream's polls hold what has arrived, far fewer.
    consumer_max_records: int = Field(default=15_000, ge=1)
    # Consumers of the group in this process (each owns some partitions; more than there are
    # partitions only wait). One by default: every member that joins stops the whole group for
    # a rebalance, which costs seconds on Tansu, more than the overlap gains on a short load.
    consumer_concurrency: int = Field(default=1, ge=1)
    # Metering as a max-register: of a run's samples in one poll, those of one quarter hour (UTC)
    # are recorded as one point, the latest, with one usage record (their delta): usage up to every
    # window boundary, hour bucket and rate change is unchanged. false: a row and a record per
    # sample (HTTP ingest, a sample per transaction, records each sample either way).
    metering_fold: bool = True
    # Each poll's transaction overlaps the next poll's decoding and validation
    # (budgetgate.messaging.subscriber.Pipeline); offsets are still committed only after the commit.
    consumer_pipelined: bool = True
    # How far past this service's clock a sample's observed_at may be: further is a clock or
    # unit bug at the exporter, and the sample is dead-lettered as future_timestamp.
    max_future_skew_seconds: float = Field(default=300.0, ge=0)
    # How far above what its run can physically have used a sample may go, as a ratio (0.05: 5 %).
    # A run used at most its GPUs (nodes) x the time since its earliest decision, the GPUs (nodes)
    # being the most any decision of the run asked for; a sample above GPUs x (observed_at -
    # earliest decided_at + the usage slack) x (1 + this), or the same for nodes, is dead-lettered
    # as impossible_usage and never charged.
    metering_usage_tolerance: float = Field(default=DEFAULT_USAGE_TOLERANCE, ge=0, le=1000, allow_inf_nan=False)
    # The usage slack: seconds added to the time since a run's earliest decision, for the clocks of
    # exporter (observed_at) and admission (decided_at), which may disagree. Unset: the same as
    # BUDGETGATE_MAX_FUTURE_SKEW_SECONDS, the disagreement the service allows a sample already.
    metering_usage_slack_seconds: float | None = Field(default=None, ge=0, le=10 * 365 * 86400, allow_inf_nan=False)
    # A sample whose run has no decision is kept pending until observed_at + this, re-checked
    # every pending_recheck_seconds, then dead-lettered as unknown_run.
    unknown_run_grace_seconds: float = Field(default=600.0, ge=0)
    pending_recheck_seconds: float = Field(default=5.0, gt=0)
    max_batch_samples: int = Field(default=1000, ge=1)
    # The most lifecycle events one POST /v1/lifecycle/events may carry.
    max_batch_events: int = Field(default=1000, ge=1)
    max_body_bytes: int = Field(default=1024 * 1024, ge=1)

    @property
    def group_id(self) -> str:
        """The consumer group joined: side-by-side stacks on one broker (BUDGETGATE_TOPIC_PREFIX)
        must not share one, as the reconciler's and evidence-emitter's do not."""
        return f"{self.topic_prefix}{self.consumer_group}"

    @property
    def max_future_skew(self) -> timedelta:
        return timedelta(seconds=self.max_future_skew_seconds)

    @property
    def metering_usage_slack(self) -> timedelta:
        seconds = self.max_future_skew_seconds if self.metering_usage_slack_seconds is None else self.metering_usage_slack_seconds
        return timedelta(seconds=seconds)

    @property
    def unknown_run_grace(self) -> timedelta:
        return timedelta(seconds=self.unknown_run_grace_seconds)
