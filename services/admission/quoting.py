"""A quote: what admission would decide on a submission now, decided exactly as admission
decides (deciding.prepare and deciding.conclude) on readings taken by the same Redis script in
its checking mode, which holds nothing. A quote records nothing, reserves nothing and never
repeats an earlier decision of the run id: it is a fresh evaluation every time."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.core.evaluation import deciding_index
from budgetgate.core.windows import rfc3339
from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.redis_ledger import RedisLedger, Reservation, ReserveResult
from budgetgate.ledger.transaction import committed_seq
from budgetgate.core.evaluation import fits
from budgetgate.decisions.concurrency import rejection
from budgetgate.services.admission.admitter import Admitter, Lack, Unavailable, releases, with_ledger
from budgetgate.decisions.deciding import Prepared, charges, conclude, holds, readings
from budgetgate.decisions.rendering import response_body
from budgetgate.contracts.admission import AdmissionRequest

sql = owned_by("budgetgate.services.admission")

_NOT_QUOTED = ("decision_id", "replayed", "decided_at")


class Quoter:
    def __init__(self, admitter: Admitter) -> None:
        self.admitter = admitter

    async def quote(self, request: AdmissionRequest, *, now: datetime | None = None) -> dict[str, Any]:
        """The answer admission would give `request` now; raises Unavailable or InvalidSubmission."""
        at = now or datetime.now(UTC)
        p = await self._prepare(request, at)
        if self.admitter.accounting is not None:
            found = await self.admitter.accounting.source(p.bundle, p.plan, p.asks.tenant, label=self.admitter.tenant_label)
            p = replace(p, accounting=found)
        ledger = self.admitter.ledger_of(request)
        syncs = [self.admitter.ledgers.sync_of(each) for each in {ledger, *([self.admitter.pools_ledger] if p.asks.pool_apart else [])}]
        result = await with_ledger(syncs, lambda: self._check(ledger, p)) if p.needs_ledger else None
        found = readings(p.plan, result)
        refused = [(p.plan, found)] if found is not None and not holds(result) else []
        async with self.admitter.pool.acquire() as conn:
            ahead = await releases(conn, refused, self.admitter.start_deadline)
        decision, view = conclude(p, result, ahead, self.admitter.decayed(p))
        body = response_body(plan=p.plan, decision=decision, decision_id="", decided_at=at, standing=view)
        deciding = deciding_index(decision)
        eligible = decision.evaluations[deciding].next_eligible_time if deciding is not None and decision.outcome != "ALLOW" else None
        answer = {k: v for k, v in body.items() if k not in _NOT_QUOTED}
        return {
            "run_id": answer.pop("run_id"),
            "attempt": answer.pop("attempt"),
            "quote": True,
            "quoted_at": rfc3339(at),
            "decision": answer.pop("decision"),
            "reason": answer.pop("reason"),
            "next_eligible_time": rfc3339(eligible) if eligible else None,
            **answer,
        }

    async def _prepare(self, request: AdmissionRequest, at: datetime) -> Prepared:
        """`request` prepared under the latest tenant overrides Postgres committed, as admission
        re-prepares a batch under them (an override made on another instance is not announced;
        this one may not have polled it yet)."""
        admitter = self.admitter
        p = admitter.prepare(request, at)
        try:
            revision = await admitter.pool.fetchval(sql("override_revision"))
            if p.bundle.override_revision >= revision:
                return p
            if admitter.policies.overrides.revision < revision:
                await admitter.policies.refresh()
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable: {exc}") from exc
        return admitter.prepare(request, at)

    async def _check(self, ledger: RedisLedger, p: Prepared) -> ReserveResult:
        admitter = self.admitter
        committed = await committed_seq(admitter.pool, ledger)
        asked = Reservation(p.request.run_id, "quote", charges(p.plan), p.asks.counters, None if p.asks.pool_apart else p.asks.pool)
        now_ms = int(datetime.now(UTC).timestamp() * 1000)
        token = await self._check_token(p, now_ms) if p.asks.pool_apart else None
        result = await ledger.check(asked, now_ms=now_ms, committed_seq=committed)
        if result.unloaded:
            # A key Redis never loaded is empty unless Postgres has it already (created a moment
            # ago by the reconciler): then it is loaded, as admission would, and read again.
            keys = [p.plan.charges[i].ledger_key for i in result.unloaded]
            rows = await admitter.pool.fetch(sql("ledger_figures"), keys)
            for row in rows:
                await ledger.load_key(row["ledger_key"], reserved=row["reserved"], consumed=row["consumed"], size=row["size"])
            if rows:
                result = await ledger.check(asked, now_ms=now_ms, committed_seq=committed)
        if token is not None:  # the token's readings, and refused when it is
            result = replace(result, pools=token.pools, status="REJECTED" if token.status == "REJECTED" else result.status)
        if result.status == "REJECTED" and (lacking := self.admitter.lacking(p, result)):
            result = await self._after_refills(p, result, lacking)
        return result

    async def _check_token(self, p: Prepared, now_ms: int) -> ReserveResult:
        """What taking the submission's pool token apart, on the pools' shard of a ledger of
        several shards, would find (Admitter._take_tokens): the same check of its levels, TAKEN
        where another holder has the token; as on one shard, a token the run holds itself is
        its own (HELD), not taken (the run's holds key, which tells the script so on one shard,
        is on its tenant's: Postgres tells it here)."""
        ledger, token = self.admitter.pools_ledger, p.asks.pool
        assert token is not None
        committed = await committed_seq(self.admitter.pool, ledger)
        result = await ledger.check(Reservation(p.request.run_id, "quote", (), (), token), now_ms=now_ms, committed_seq=committed)
        if any(r.check == "TAKEN" for r in result.pools) and await self.admitter.pool.fetchval(sql("holds_own_token"), token.token, p.request.run_id):
            pools = tuple(replace(r, check="HELD") if r.check == "TAKEN" else r for r in result.pools)
            result = replace(result, pools=pools, status="REJECTED" if any(r.check in ("EXHAUSTED", "CAP") for r in pools) else "FITS")
        return result

    async def _after_refills(self, p: Prepared, result: ReserveResult, lacking: list[Lack]) -> ReserveResult:
        """The check as it would read after the one refill admission gives a submission whose
        tenant's escrow leases lack room (Admitter._refill): each lease's size grown by what the
        refill would grant now (Escrow.refill_forecast), and FITS when every lease then has room
        and nothing else refuses."""
        admitter = self.admitter
        sizes, counter_sizes = list(result.sizes), list(result.counter_sizes)
        for lack in lacking:
            limit = p.plan.charges[lack.charge].policy.limit.amount if lack.charge is not None else 0
            grown = await admitter.escrow.refill_forecast(
                lack.book, lack.root, amount=lack.amount, reading=(lack.seen.reserved, lack.seen.consumed), chunk=lack.chunk, limit=limit
            )
            if lack.charge is not None:
                sizes[lack.charge] = (sizes[lack.charge] or 0) + grown
            else:
                assert lack.counter is not None
                counter_sizes[lack.counter] = (counter_sizes[lack.counter] or 0) + grown
        forecast = replace(result, sizes=tuple(sizes), counter_sizes=tuple(counter_sizes))
        found = readings(p.plan, forecast) or {}
        if all(fits(c.amount, found[c.ledger_key]) for c in p.plan.charges if c.hard) and rejection(p.bundle, p.request, p.asks, forecast) is None:
            forecast = replace(forecast, status="FITS")
        return forecast
