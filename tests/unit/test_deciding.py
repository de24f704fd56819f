"""deciding.prepare and conclude, shared by admission, quotes, explain and replay: only a hard
policy refuses a submission; a soft or dry-run one records what it would have said."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.ledger.redis_ledger import ReserveResult
from budgetgate.decisions.deciding import InvalidSubmission, conclude, prepare
from budgetgate.contracts.admission import AdmissionRequest
from tests.support.admission import budget_yaml, submission

AT = datetime(2026, 3, 10, 12, tzinfo=UTC)
RATES = """apiVersion: budgetgate/v1
kind: RateCard
metadata: {id: rates}
spec:
  currency: USD
  rates: [{flavor: h100, rate_per_gpu_hour: 3.933}]
"""


def bundle(trial_enforcement: str):  # type: ignore[no-untyped-def]
    texts = {
        "team.yaml": budget_yaml("team", limit="gpu_hours: 500"),
        # The README's trial: an org-wide cost cap requiring cost-center, before it is enforced.
        "org.yaml": budget_yaml("org-cap", labels="{cost-center: '*'}", limit="cost: 100000, currency: USD", enforcement=trial_enforcement),
        "rates.yaml": RATES,
    }
    return build_bundle([d for name, text in texts.items() for d in parse_text(text, name)], git_sha="a" * 40)


def request(**overrides: object) -> AdmissionRequest:
    return AdmissionRequest.model_validate(submission(**{"labels": {"team": "vision"}, **overrides}))


@pytest.mark.parametrize("enforcement", ["soft", "dry-run"])
@pytest.mark.parametrize("resources", [{"gpus": 8, "flavor": "b200"}, {"gpus": 8}, {"gpus": 8, "flavor": "h100"}])
def test_a_soft_or_dry_run_cap_neither_refuses_nor_denies(enforcement: str, resources: dict[str, object]) -> None:
    p = prepare(bundle(enforcement), request(resources=resources), AT)
    assert p.needs_ledger and [c.policy.id for c in p.plan.charges] == ["team"]
    decision, _view = conclude(p, ReserveResult("RESERVED", readings=((0, 0),)), None)
    assert decision.outcome == "ALLOW"
    assert {e.policy_id: e.outcome for e in decision.evaluations} == {"team": "ALLOW", "org-cap": "DENY"}
    assert "not enforced" in decision.reason and "'org-cap'" in decision.reason


def test_the_same_cap_enforced_hard_denies_for_the_missing_label() -> None:
    p = prepare(bundle("hard"), request(resources={"gpus": 8, "flavor": "h100"}), AT)
    assert not p.needs_ledger
    decision, _view = conclude(p, None, None)
    assert decision.outcome == "DENY" and "requires label cost-center" in decision.reason


def test_a_hard_cost_cap_refuses_an_unpriced_flavor() -> None:
    with pytest.raises(InvalidSubmission) as raised:
        prepare(bundle("hard"), request(labels={"team": "vision", "cost-center": "1042"}, resources={"gpus": 8, "flavor": "b200"}), AT)
    assert raised.value.field == "resources.flavor"
