"""One way to decide, whoever asks: admission, a quote, explain and replay all go from a
submission to a `Prepared` plan (`prepare`) and from what the ledger read for it to the decision
and the scheduler's standing (`conclude`). Only where the readings come from differs: the
reserving script, the checking script, or the readings recorded with a past decision."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from budgetgate.core.accounting import BudgetSource, with_external
from budgetgate.core.decay import Decayed
from budgetgate.core.eligibility import Held, Outlook
from budgetgate.core.ledger_key import AmountOutOfRange
from budgetgate.core.escrow import lease_of
from budgetgate.core.evaluation import Decision, NoTenant, Plan, Reading, Resources, Submission, UnknownFlavor, decide, plan
from budgetgate.core.shards import run_root
from budgetgate.core.policy import PolicyBundle
from budgetgate.ledger.holds import PoolReading
from budgetgate.ledger.redis_ledger import ChargeRequest, ReserveResult
from budgetgate.decisions.concurrency import Asks, NoSensitiveTenant, NoSuchPool, asks, refused, rejection, standing
from budgetgate.contracts.admission import AdmissionRequest


class InvalidSubmission(ValueError):
    """The submission is well-formed JSON but cannot be evaluated; `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Disagreement(RuntimeError):
    """The ledger's atomic step and the evaluation disagree about room (a bug, or corrupt readings)."""


@dataclass(frozen=True)
class Prepared:
    """A submission's pure part: the plan on its budgets and the concurrency it asks for."""

    request: AdmissionRequest
    bundle: PolicyBundle
    plan: Plan
    asks: Asks
    at: datetime
    accounting: BudgetSource | None = None  # the external accounting figure, when one was asked

    @property
    def needs_ledger(self) -> bool:
        return not self.plan.violations and bool(self.plan.charges or self.asks.any)


def prepare(
    bundle: PolicyBundle,
    request: AdmissionRequest,
    at: datetime,
    *,
    unmatched: str = "allow",
    tenant_label: str = "team",
    covering: PolicyBundle | None = None,
    leased: bool = False,
) -> Prepared:
    """Plan `request` under `bundle` at `at`; raises InvalidSubmission. `covering` is `bundle`
    narrowed to the policies that can apply (a cache), planned with instead when given. `leased`:
    the ledger has several shards, so the budgets tenants share are charged through the run's
    tenant's escrow leases (core.evaluation.plan)."""
    lease_root = run_root(request.labels, tenant_label) if leased else None
    try:
        the_plan = plan(covering or bundle, submission(request, at), lease_root=lease_root, tenant_label=tenant_label)
    except NoTenant as exc:
        raise InvalidSubmission(f"labels.{tenant_label}", str(exc)) from exc
    except UnknownFlavor as exc:
        raise InvalidSubmission("resources.flavor", str(exc)) from exc
    except AmountOutOfRange as exc:
        # Refused on its own, before it joins a batch: it once failed its whole batch with a 500.
        raise InvalidSubmission("projected_runtime_hours", f"{exc}: ask for fewer resources or a shorter runtime") from exc
    if not the_plan.charges and not the_plan.violations and unmatched == "deny":
        raise InvalidSubmission("namespace", f"no budget policy covers namespace {request.namespace!r} with these labels, and unmatched submissions are denied")
    try:
        the_asks = asks(bundle, request, tenant_label=tenant_label, now=at, leased=leased)
    except NoSuchPool as exc:
        raise InvalidSubmission("pool_token.namespace", str(exc)) from exc
    except NoSensitiveTenant as exc:
        raise InvalidSubmission(f"labels.{tenant_label}", str(exc)) from exc
    return Prepared(request, bundle, the_plan, the_asks, at)


def submission(request: AdmissionRequest, at: datetime) -> Submission:
    res = request.resources
    return Submission(
        run_id=request.run_id,
        attempt=request.attempt,
        namespace=request.namespace,
        labels=dict(request.labels),
        resources=Resources(gpus=res.gpus, nodes=res.nodes, flavor=res.flavor, region=res.region),
        runtime_hours=Decimal(repr(request.projected_runtime_hours)),
        at=at,
    )


def charges(the_plan: Plan) -> tuple[ChargeRequest, ...]:
    """What the ledger script checks (and reserves) for a plan."""
    return tuple(ChargeRequest(c.ledger_key, c.amount, c.policy.limit.amount, c.hard, lease=c.root is not None) for c in the_plan.charges)


def readings(the_plan: Plan, result: ReserveResult | None) -> dict[str, Reading] | None:
    """What each budget held before the decision, as the script read it; None when the ledger
    was not consulted (a label violation, or nothing to hold)."""
    if result is None:
        return None
    sizes = result.sizes or (None,) * len(the_plan.charges)
    return {
        # An escrow lease's limit is its size: what its tenant may hold of the budget.
        c.ledger_key: Reading(c.policy.limit.amount if size is None else size, reserved, consumed)
        for c, (reserved, consumed), size in zip(the_plan.charges, result.readings, sizes, strict=True)
    }


def holds(result: ReserveResult | None) -> bool:
    """Whether the script reserved (or, for a check, would reserve) what was asked."""
    return result is not None and result.status in ("RESERVED", "FITS")


def conclude(p: Prepared, result: ReserveResult | None, outlooks: dict[str, Outlook] | None, usage: Decayed | None = None) -> tuple[Decision, dict[str, Any]]:
    """The decision and the standing (penalty, fair share) from what the ledger read and the
    tenant's decayed usage (`usage`, reckoned at the decision); raises Disagreement when the
    script's verdict and the evaluation's differ."""
    found = with_external(p.plan, readings(p.plan, result), p.accounting)
    decision = decide(p.plan, found, outlooks=outlooks)
    if result is not None and result.status == "REJECTED":
        reason = rejection(p.bundle, p.request, p.asks, result)
        if reason is not None:
            decision = refused(decision, reason)
        elif decision.admitted:
            raise Disagreement(f"the ledger refused run {p.request.run_id!r} but the evaluation finds room everywhere")
    elif holds(result) and not decision.admitted:
        raise Disagreement(f"the ledger reserved for run {p.request.run_id!r} but the evaluation refuses it")
    view = standing(p.bundle, p.request, p.asks, p.plan, found, result, usage).body()  # type: ignore[arg-type]
    return decision, {**view, "accounting": p.accounting.body() if p.accounting else None}


def rebuilt_result(recorded: dict[str, Any]) -> ReserveResult | None:
    """The script's answer as recorded with a decision (readings_record), for recomputing it."""
    if recorded.get("status") is None:
        return None
    return ReserveResult(
        recorded["status"],
        readings=tuple((r["reserved"], r["consumed"]) for r in recorded.get("ledger", [])),
        sizes=tuple(r["limit"] if lease_of(r["ledger_key"]) is not None else None for r in recorded.get("ledger", [])),
        counters=tuple(tuple(c) for c in recorded.get("counters", [])),  # type: ignore[misc]
        counter_sizes=tuple(recorded.get("counter_sizes", ())),
        pools=tuple(PoolReading(*p) for p in recorded.get("pools", [])),
    )


def rebuilt_outlooks(recorded: dict[str, Any]) -> dict[str, Outlook]:
    """The outlooks a DELAY's next eligible time was computed from, as recorded with it."""
    return {
        key: Outlook(
            holds=tuple(Held(h[0], h[1], datetime.fromisoformat(h[2]), datetime.fromisoformat(h[3])) for h in o.get("holds", [])),
            buckets=tuple((datetime.fromisoformat(b[0]), b[1]) for b in o.get("buckets", [])),
        )
        for key, o in recorded.get("outlooks", {}).items()
    }


def readings_record(
    p: Prepared, result: ReserveResult | None, outlooks: dict[str, Outlook] | None, *, tenant_label: str, usage: Decayed | None = None
) -> dict[str, Any]:
    """Everything the decision was made on besides the submission and the bundle, as stored
    with it (decisions.readings) and carried by the evidence: each ledger key's limit, reserved
    and consumed as the script read them, the concurrency readings, the outlooks a DELAY's
    time was computed from, and the tenant's decayed usage its fair share was measured on."""
    found = readings(p.plan, result) or {}
    used = {c.ledger_key for c in p.plan.charges}
    record = {
        "version": 1,
        "status": result.status if result is not None else None,
        "tenant_label": tenant_label,
        "accounting": p.accounting.record() if p.accounting else None,
        "ledger": [
            {"ledger_key": c.ledger_key, "limit": r.limit, "reserved": r.reserved, "consumed": r.consumed}
            for c in p.plan.charges
            if (r := found.get(c.ledger_key)) is not None
        ],
        "counters": [list(c) for c in result.counters] if result is not None else [],
        "pools": [[r.check, r.used, r.by_project, r.by_sub_namespace] for r in result.pools] if result is not None else [],
        "outlooks": {
            key: {
                "holds": [[h.amount, h.started, h.start_deadline.isoformat(), h.expected_end.isoformat()] for h in o.holds],
                "buckets": [[b.isoformat(), amount] for b, amount in o.buckets],
            }
            for key, o in (outlooks or {}).items()
            if key in used
        },
    }
    if usage is not None:
        record["fair_share_usage"] = {"gpu": usage.amount, "half_life_seconds": usage.half_life.total_seconds()}
    if result is not None and any(size is not None for size in result.counter_sizes):
        record["counter_sizes"] = list(result.counter_sizes)  # a lease of the sensitive pool: its size is the limit
    if any(c.root is not None for c in p.plan.charges) or any(c.lease for c in p.asks.counters):
        record["leased"] = True  # charged through escrow leases: explain prepares it so again
    return record


def rebuilt_usage(recorded: dict[str, Any], at: datetime) -> Decayed | None:
    """The decayed usage a decision's fair share was measured on, as recorded with it."""
    found = recorded.get("fair_share_usage")
    return None if found is None else Decayed(found["gpu"], at, timedelta(seconds=found["half_life_seconds"]))
