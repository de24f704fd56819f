"""Settings of the admission service (BUDGETGATE_ variables)."""

from __future__ import annotations

from typing import Literal

from budgetgate.settings import CommonSettings


class AdmissionSettings(CommonSettings):
    service_name: str = "budgetgate-admission"
    host: str = "127.0.0.1"
    port: int = 8080
    pg_pool_min: int = 2
    pg_pool_max: int = 20
    # What a submission that no budget covers gets: allowed (and recorded), or rejected.
    unmatched: Literal["allow", "deny"] = "allow"
    policy_refresh_seconds: float = 5.0
    # The label whose value names the tenant that quotas and fair shares apply to.
    tenant_label: str = "team"
    max_body_bytes: int = 64 * 1024
    # A Redis hold older than this whose decision is not in Postgres is an orphan of a process
    # that died between reserving and committing, and is released.
    orphan_grace_seconds: float = 120.0
