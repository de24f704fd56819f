"""Settings shared by every service and the CLI, read from BUDGETGATE_* variables.

Precedence: environment variables, then the state file that `budgetgate dev up` writes in the
working directory or a parent (`.budgetgate/dev.json`; BUDGETGATE_HOME names the folder instead), then the defaults below. So a CLI command run in a
checkout reaches the stack that `dev up` started there without further configuration.

One exception: where `dev up` derived a value from a variable (a database of the checkout's own
on the server BUDGETGATE_POSTGRES_DSN names), the state file records a digest of the variable's
value under `from_env` (not the value: it may hold a password); while the variable still has that
value, the derived one wins, since that variable is what the stack was built from.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr
from budgetgate.runtime.garbage import THRESHOLDS
from budgetgate.runtime.kafka_access import KafkaAccess
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

DEV_STATE_FILE = Path(".budgetgate") / "dev.json"


def find_dev_state(start: Path | None = None) -> Path | None:
    """The state file of the local stack: under BUDGETGATE_HOME when set, else the first
    `.budgetgate/dev.json` in the current folder or one of its parents."""
    home = os.environ.get("BUDGETGATE_HOME")
    if home:
        path = Path(home).expanduser() / DEV_STATE_FILE
        return path if path.is_file() else None
    here = (start or Path.cwd()).resolve()
    return next((folder / DEV_STATE_FILE for folder in (here, *here.parents) if (folder / DEV_STATE_FILE).is_file()), None)


def fingerprint(value: str) -> str:
    """What the state file keeps of a variable's value: enough to tell it changed, not what it was."""
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()


def dev_token(role: str = "operator") -> str | None:
    """The API token a CLI command sends: BUDGETGATE_TOKEN, else the local stack's token of `role`."""
    token = os.environ.get("BUDGETGATE_TOKEN")
    if token:
        return token
    path = find_dev_state()
    if path is None:
        return None
    try:
        return json.loads(path.read_text()).get("tokens", {}).get(role)
    except (OSError, ValueError, AttributeError):
        return None


class _DevStateSource(PydanticBaseSettingsSource):
    """Values published by a running `budgetgate dev up` in the current directory; with
    `derived_only`, just those derived from a variable that still has the recorded value."""

    def __init__(self, settings_cls: type[BaseSettings], *, derived_only: bool = False) -> None:
        super().__init__(settings_cls)
        self.derived_only = derived_only

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = find_dev_state()
        if path is None:
            return {}
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        fields = self.settings_cls.model_fields
        values = {k: v for k, v in state.get("settings", {}).items() if k in fields}
        if not self.derived_only:
            return values
        derived = state.get("from_env", {})
        prefix = self.settings_cls.model_config.get("env_prefix", "")
        return {k: v for k, v in values.items() if k in derived and fingerprint(os.environ.get(f"{prefix}{k}".upper(), "")) == derived[k]}


class CommonSettings(BaseSettings):
    """Connection settings every budgetgate process needs."""

    model_config = SettingsConfigDict(env_prefix="BUDGETGATE_", extra="ignore")

    postgres_dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Every Redis key budgetgate writes starts with this prefix inside a hash tag (`{prefix}`;
    # `{prefix:i}` on shard i of several, see ledger_shards), so one decision's keys always share
    # a Redis Cluster slot and deployments can share a server.
    redis_prefix: str = "bg"
    # Shards of the Redis ledger (budgetgate.core.shards, docs/scale-out.md): each root (a
    # tenant, the value of `tenant_label`, or the organisation `budgetgate ledger roots` pinned
    # it under) keeps every key of its decisions under the tag of its shard, `{prefix:i}`, so the
    # shards spread over a Redis Cluster's masters. 1 keeps the one tag `{prefix}`. With more
    # than one, a budget several tenants share (its scope names no one tenant, or is attached to
    # an account) is charged through each tenant's escrow lease of it, and so is the
    # sensitive-workload quota; token pools live on a shard of their own, where a run's
    # `pool_token` is taken before the rest of its decision. Change it only with every process
    # stopped, then run `budgetgate ledger rebuild-redis` (every shard rebuilt, the keys of the
    # former ones deleted) before starting them.
    ledger_shards: int = Field(default=1, ge=1, le=64)
    # An escrow lease's chunk, as a share of its budget's limit: a decision its tenant's lease
    # refuses asks once for what it lacks in whole chunks, and an idle lease keeps one unused.
    escrow_chunk_share: float = Field(default=0.02, gt=0, le=1)
    # The label whose value names a run's tenant: the tenant that quotas and fair shares apply
    # to, that exporter tokens limited to tenants report for, and the root of the ledger's shards.
    tenant_label: str = "team"
    kafka_bootstrap: str = "127.0.0.1:9092"
    # Prefix for topic names, so tests and side-by-side stacks can share one broker.
    topic_prefix: str = ""
    # What budgetgate.messaging.topic_admin.ensure_topics creates a missing topic with (existing topics are
    # left as they are). One replica suits the one-broker local stack only: production brokers
    # want 3 (see deploy/kubernetes/README.md), and a consumer group uses at most one consumer
    # per partition.
    topic_partitions: int = Field(default=3, ge=1)
    topic_replication_factor: int = Field(default=1, ge=1)
    # How long a schema migration waits for a table lock before it gives up (and says who held
    # it): a migration waiting on a long transaction would queue every admission behind itself.
    migration_lock_timeout_seconds: float = Field(default=5.0, gt=0)
    # The monthly partitions of the ledger's growing tables (decisions, their evaluations, usage
    # records, the outbox) the services writing them create ahead of this month, on start and once
    # an hour (budgetgate.ledger.partitions). A decision or usage record of a month without one
    # lands in its table's default partition and is moved out when its month is created; an
    # outbox row of such a month is refused, hence at least 1.
    ledger_partitions_ahead_months: int = Field(default=3, ge=1, le=120)
    service_name: str = "budgetgate"
    otlp_endpoint: str | None = Field(default=None, description="OTLP/HTTP endpoint; none = no export")
    # Outbox records the relay claims, publishes together and marks in one transaction (a
    # bundle row that carries more goes alone): the relay waits for the broker once per batch,
    # so this bounds the rate it keeps up with.
    outbox_batch: int = Field(default=1000, ge=1, le=100_000)
    # How Kafka clients reach the brokers: PLAINTEXT (the local stack), SSL, SASL_PLAINTEXT or
    # SASL_SSL, with a SASL mechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) and credentials.
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: str | None = None
    # How long a consumer of a group may go without a heartbeat before the broker gives its
    # partitions to the others (the consumers heartbeat every third of it, at most every 3 s).
    # Kafka brokers accept 6 s to 30 min by default (group.min/max.session.timeout.ms); a
    # shorter one hands a dead consumer's partitions over sooner but takes a loop stalled that
    # long for a dead one. The local broker (Tansu) also completes a join after half of it.
    kafka_session_timeout_ms: int = Field(default=10_000, ge=1_000, le=1_800_000)
    # How old a consumer's view of the topics' partitions may grow before it asks the brokers
    # again. A partition it does not know of is read by no member of its group: one added to a
    # topic, or a topic a broker that lost its state made anew with its own partition count
    # (brokers create a topic a producer asks for: Tansu with 4 partitions, Kafka with
    # num.partitions) sits unread until then. Kafka's clients wait 5 minutes; each look is one
    # small metadata request.
    kafka_metadata_max_age_ms: int = Field(default=10_000, ge=1_000, le=3_600_000)
    # How long a consumer remembers what it applied: the event ids in its inbox and its polls'
    # offsets (consumer_offsets; each partition's latest is always kept), pruned every hour by
    # each consuming service. A message delivered again later than this would be applied again,
    # so keep it above the retention of the topics read (Kafka's retention.ms, 7 days by
    # default): a group whose committed offsets expired reads its topics from the start.
    consumer_retention_hours: float = Field(default=336.0, gt=0)

    @property
    def consumer_retention(self) -> timedelta:
        """`consumer_retention_hours`, what each consuming service's `prune_forever` keeps."""
        return timedelta(hours=self.consumer_retention_hours)

    @property
    def kafka_group_timing(self) -> dict[str, int]:
        """The session timeout and heartbeat of every consumer group member of this process
        (aiokafka's and FastStream's keyword arguments)."""
        session = self.kafka_session_timeout_ms
        return {"session_timeout_ms": session, "heartbeat_interval_ms": min(3_000, session // 3)}

    @property
    def kafka_access(self) -> KafkaAccess:
        """The access every Kafka client of this process uses."""
        password = self.kafka_sasl_password.get_secret_value() if self.kafka_sasl_password else None
        return KafkaAccess(self.kafka_security_protocol, self.kafka_sasl_mechanism, self.kafka_sasl_username, password, self.kafka_ssl_cafile)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            _DevStateSource(settings_cls, derived_only=True),
            env_settings,
            _DevStateSource(settings_cls),
            file_secret_settings,
        )


class RetentionSettings(CommonSettings):
    """What `budgetgate ledger archive` keeps in Postgres, and where it writes what it does not."""

    # Months of decisions (with their evaluations) and usage records kept in Postgres: a month
    # that ended this many calendar months ago or longer is archived to files and dropped by
    # `budgetgate ledger archive`. Unset (the default), nothing is archived.
    ledger_retention_months: int | None = Field(default=None, ge=1)
    # Where `budgetgate ledger archive` writes the archives (`<dir>/<series>/<YYYY-MM>/`, a
    # manifest and a compressed CSV file per table); `--to` overrides it.
    ledger_archive_dir: str | None = None


class ServingSettings(CommonSettings):
    """What an HTTP-serving process adds: TLS from a certificate and key (PEM files); both
    unset = plain HTTP. Processes listen on loopback unless told otherwise (their `host`)."""

    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    # Seconds an idle HTTP keep-alive connection is kept open. Longer than every client's and
    # proxy's idle timeout in front of the service (the Kubernetes API server's webhook client
    # keeps idle connections 90 s, most load balancers 60 s): a server that closes an idle
    # connection first races the client's next request on it, which then fails unanswered
    # (a POST is not retried). uvicorn's own default is 5 s.
    http_keep_alive_seconds: int = Field(default=120, gt=0)
    # The cyclic garbage collector's thresholds (gc.set_threshold; budgetgate.runtime.garbage says why
    # not CPython's 700, 10, 10), as a JSON list: BUDGETGATE_GC_THRESHOLDS='[700, 10, 10]'.
    # A first threshold of 0 turns automatic collection off.
    gc_thresholds: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]] = THRESHOLDS
