"""Token pools toward external services: allocate, release and inspect, atomically across a
namespace and its declared ancestors, durable in Postgres before the answer (like a decision)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import asyncpg

from budgetgate.core.policy import PolicyBundle
from budgetgate.core.windows import rfc3339
from budgetgate.ledger.holds import PoolRequest
from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.ledger.redis_sync import LedgerSync, undo_unless_committed
from budgetgate.ledger.transaction import committed_seq, ledger_transaction, record_ledger_mark
from budgetgate.core.principals import Forbidden, Principal, Role
from budgetgate.services.admission.admitter import Unavailable, with_ledger
from budgetgate.decisions.concurrency import pool_request
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.services.admission.resubmission import Conflict
from budgetgate.contracts.admission import AllocationIn

sql = owned_by("budgetgate.services.admission")

log = logging.getLogger(__name__)

# The answers platforms know from Flyte's resource manager.
STATUSES = {"GRANTED": "Granted", "RENEWED": "Granted", "EXHAUSTED": "Exhausted", "CAP": "NamespaceQuotaExceeded"}


class TokenPools:
    def __init__(self, *, pool: asyncpg.Pool, ledger: RedisLedger, sync: LedgerSync, policies: PolicyStore) -> None:
        self.pool = pool
        self.ledger = ledger
        self.sync = sync
        self.policies = policies

    def _bundle(self) -> PolicyBundle:
        if self.policies.current is None:
            raise Unavailable("no policy bundle has been applied yet; run `budgetgate policy apply`")
        return self.policies.current

    async def allocate(self, namespace: str, body: AllocationIn, *, principal: Principal) -> dict[str, Any]:
        """One token, idempotent per token: asking again renews its lease. Raises NoSuchPool,
        Forbidden when the token is held by another principal, or TokenMoved when a renewal asks
        for another project or sub-namespace than the token is held for."""
        now = datetime.now(UTC)
        request = pool_request(
            self._bundle(),
            namespace,
            token=body.token,
            project=body.project or "",
            sub_namespace=body.sub_namespace or "",
            constraints=body.constraints.model_dump() if body.constraints else {},
            lease_seconds=body.lease_seconds,
            now=now,
        )
        expires = datetime.fromtimestamp(request.expiry_ms / 1000, UTC)

        async def work() -> dict[str, Any]:
            status, readings = "", ()
            async with self.pool.acquire() as conn:
                tx = conn.transaction()
                await tx.start()
                try:
                    await conn.execute(sql("lock_ledger_shared"), self.ledger.shard)
                    await conn.execute(sql("lock_pool_token"), namespace, body.token)
                    held = await conn.fetchrow(sql("pool_allocation_principal"), namespace, body.token)
                    _require_holder(principal, held, namespace, body.token)
                    asked = _renewal(held, request, body, namespace)
                    # A statement of its own, after the lock: in one with it, the snapshot would
                    # be taken before the lock was granted (see budgetgate_begin_batch).
                    committed = await committed_seq(conn, self.ledger)
                    status, readings, seq = await self.ledger.allocate(asked, now_ms=int(now.timestamp() * 1000), committed_seq=committed)
                    await record_ledger_mark(conn, self.ledger, seq)
                    if status in ("GRANTED", "RENEWED"):
                        levels = [level.namespace for level in asked.levels]
                        await conn.execute(
                            sql("upsert_pool_allocation"), namespace, body.token, levels, asked.project, asked.sub_namespace, None, expires, principal.name
                        )
                    await tx.commit()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await tx.rollback()
                    if status == "GRANTED":
                        await self._undo(namespace, body.token, [level.namespace for level in request.levels])
                    raise
            granted = status in ("GRANTED", "RENEWED")
            return {
                "status": STATUSES[status],
                "namespace": namespace,
                "token": body.token,
                "renewed": status == "RENEWED",
                "lease_expires_at": rfc3339(expires) if granted else None,
                "levels": [
                    {
                        "namespace": level.namespace,
                        "quota": level.quota,
                        "used": reading.used + (1 if status == "GRANTED" else 0),
                        "project_cap": level.project_cap,
                        "namespace_cap": level.namespace_cap,
                    }
                    for level, reading in zip(request.levels, readings, strict=True)
                ],
            }

        return await with_ledger(self.sync, work)

    async def _undo(self, namespace: str, token: str, levels: list[str]) -> None:
        """Give back a grant whose row did not commit, or invalidate Redis if that is unknown."""
        await undo_unless_committed(
            self.ledger,
            committed=lambda: self.pool.fetchval("SELECT 1 FROM pool_allocations WHERE namespace = $1 AND token = $2 AND state = 'held'", namespace, token),
            undo=lambda: self.ledger.deallocate(levels, token),
            what=f"token {token!r} in {namespace!r}",
        )

    async def release(self, namespace: str, token: str, *, principal: Principal) -> dict[str, Any]:
        """Give a token back; releasing one that is not held is not an error. A principal
        other than an operator releases only the tokens it holds (Forbidden otherwise)."""
        operator = Role.OPERATOR in principal.roles

        async def work() -> dict[str, Any]:
            async with ledger_transaction(self.pool, self.ledger) as tx:
                conn = tx.conn
                if not operator:
                    held = await conn.fetchrow(sql("pool_allocation_principal"), namespace, token)
                    if held is None:
                        return {"namespace": namespace, "token": token, "released": False}
                    _require_holder(principal, held, namespace, token)
                levels = await conn.fetchval(sql("release_pool_allocation"), namespace, token)
                if levels is None:  # not in Postgres: drop any copy Redis has on the current chain
                    levels = [p.namespace for p in self._bundle().pool_chain(namespace)]
                released = 0
                if levels:
                    # Redis last, and marked changed before the call: should the commit fail, or
                    # the reply be lost, Redis (which freed a token Postgres still holds) is
                    # invalidated and rebuilt rather than left looser than Postgres.
                    tx.changing(self.ledger)
                    released = await self.ledger.deallocate(levels, token)
            return {"namespace": namespace, "token": token, "released": released > 0}

        return await with_ledger(self.sync, work)

    async def status(self, namespace: str) -> dict[str, Any] | None:
        """Used, quota and holders of a declared pool (leases that ran out are not counted)."""
        declared = {p.namespace: p for p in self._bundle().pools}.get(namespace)
        if declared is None:
            return None

        async def work() -> dict[str, Any]:
            if not await self.ledger.is_loaded():
                await self.sync.ensure_loaded()
            now_ms = int(datetime.now(UTC).timestamp() * 1000)
            leases, owners, projects, subns = self.ledger.keys.pool(namespace)
            live = await self.ledger.client.zrangebyscore(leases, now_ms + 1, "+inf", withscores=True)
            who = await self.ledger.client.hgetall(owners)
            holders = []
            for token, expiry in live:
                owner = who.get(token, b"\t").decode()
                project, _, sub = owner.partition("\t")
                holders.append(
                    {
                        "token": token.decode(),
                        "project": project or None,
                        "sub_namespace": sub or None,
                        "lease_expires_at": rfc3339(datetime.fromtimestamp(expiry / 1000, UTC)),
                    }
                )
            return {
                "namespace": namespace,
                "quota": declared.quota,
                "used": len(holders),
                "project_cap": declared.project_cap,
                "namespace_cap": declared.namespace_cap,
                "holders": holders,
            }

        return await with_ledger(self.sync, work)


class TokenMoved(Conflict):
    """A renewal asks for another project or sub-namespace than its token is held for (409)."""

    def __init__(self, namespace: str, token: str, fields: list[str]) -> None:
        super().__init__(
            f"token {token!r} of pool {namespace!r} is held for another {' and '.join(fields)}; a renewal keeps them: "
            "release it and allocate it again (the new one's caps apply)",
            fields,
        )


def _renewal(held: Any, request: PoolRequest, body: AllocationIn, namespace: str) -> PoolRequest:
    """`request` as a renewal of `held` (the token's row while held, or None): a project or
    sub-namespace left out keeps the one it is held for; another one is TokenMoved, since moving
    the token would escape the new one's cap."""
    if held is None:
        return request
    kept = replace(
        request,
        project=held["project"] if body.project is None else request.project,
        sub_namespace=held["sub_namespace"] if body.sub_namespace is None else request.sub_namespace,
    )
    fields = [name for name in ("project", "sub_namespace") if held[name] != getattr(kept, name)]
    if fields:
        raise TokenMoved(namespace, request.token, fields)
    return kept


def _require_holder(principal: Principal, held: Any, namespace: str, token: str) -> None:
    """`held` (the token's row while held, or None) is free or held by `principal`."""
    if held is not None and held["principal"] != principal.name:
        holder = repr(held["principal"]) if held["principal"] else "a submission"
        raise Forbidden(
            f"{principal.name!r} does not hold token {token!r} in pool {namespace!r} (held by {holder}); only its holder or an operator may release or renew it"
        )
