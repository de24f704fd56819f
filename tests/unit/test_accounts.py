"""The account tree (core/accounts.py): scopes laid over their parents', budgets attached to an
account covering its whole subtree, and every refusal of `policy validate`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budgetgate.core.loader import PolicyValidationError, build_bundle, parse_text
from tests.support.accounts import account_budget, account_tree

TREE = account_tree()


def account(account_id: str, spec: str) -> str:
    return f"\n---\napiVersion: budgetgate/v1\nkind: Account\nmetadata: {{id: {account_id}}}\nspec: {spec}"


def bundle(text: str):  # type: ignore[no-untyped-def]
    return build_bundle(parse_text(text, "accounts.yaml"), git_sha="a" * 40)


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyValidationError) as caught:
        bundle(text)
    return [e.message for e in caught.value.errors]


def test_a_users_scope_is_laid_over_its_teams_and_a_department_covers_its_teams() -> None:
    b = bundle(TREE + account_budget("research-month", "research", 100) + account_budget("alice-month", "alice", 10))
    tree = b.accounts
    assert tree.accounts["alice"].scope.scope_id == "ns=vision;team=vision;user=alice"
    assert tree.ancestors("alice") == ["vision", "research", "acme"]
    research, alice = (p for p in b.policies)
    assert (research.scope.scope_id, alice.scope.scope_id) == ("account=research", "account=alice")
    # A run of alice charges both; a run of nlp only the department's; another run neither.
    assert research.scope.matches("vision", {"team": "vision", "user": "alice"}) and alice.scope.matches("vision", {"team": "vision", "user": "alice"})
    assert research.scope.matches("nlp", {}) and not alice.scope.matches("nlp", {"user": "alice"})
    assert not research.scope.matches("other", {"team": "vision"})
    assert research.scope.namespaces == frozenset({"vision", "nlp"})
    assert tree.account_of("vision", {"team": "vision", "user": "alice"}) == "alice"
    assert tree.account_of("vision", {"team": "vision", "user": "bob"}) == "vision"
    assert tree.account_of("elsewhere", {}) is None
    assert tree.lines() == [
        "acme (organisation): what the accounts below it cover",
        "  research (department): what the accounts below it cover",
        "    nlp (team): ns=nlp",
        "    vision (team): ns=vision;team=vision",
        "      alice (user): ns=vision;team=vision;user=alice",
    ]


def test_scope_only_bundles_have_no_tree() -> None:
    b = bundle(
        """apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata: {id: plain}
spec: {scope: {namespace: vision}, window: {calendar: month}, limit: {gpu_hours: 5}}
"""
    )
    assert not b.accounts and b.policies[0].scope.scope_id == "ns=vision"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            account("loop-a", "{level: team, parent: loop-b, scope: {namespace: la}}")
            + account("loop-b", "{level: team, parent: loop-a, scope: {namespace: lb}}"),
            "accounts form a cycle: loop-a -> loop-b -> loop-a",
        ),
        (
            account("orphan", "{level: team, parent: nowhere, scope: {namespace: o}}"),
            "account 'orphan' has parent 'nowhere', which no Account document defines",
        ),
        (
            account("twin", "{level: team, parent: research, scope: {namespace: nlp}}"),
            "accounts 'nlp' (accounts.yaml:22) and 'twin' both claim scope ns=nlp",
        ),
        (
            account("upside", "{level: department, parent: vision, scope: {namespace: vision, labels: {x: y}}}"),
            "account 'upside' is a department under 'vision', a team: a department sits under an organisation",
        ),
        (
            account("bob", "{level: user, parent: research, scope: {labels: {user: bob}}}"),
            "account 'bob' is a user under 'research', a department: a user sits under a team",
        ),
        (
            account("empty", "{level: department, parent: acme}"),
            "account 'empty' covers no runs: give it a scope, or accounts below it that have one",
        ),
        (
            account("stray", "{level: user, parent: vision, scope: {namespace: nlp, labels: {user: s}}}"),
            "account 'stray' names namespace(s) nlp outside its parent's (vision)",
        ),
        (account_budget("lost", "nobody", 5), "policy 'lost' is attached to account 'nobody', which no Account document defines"),
        (
            account_budget("dept", "research", 10) + account_budget("team", "vision", 20),
            "policy 'team' gives account 'vision' 20 gpu-hours, more than 10 gpu-hours",
        ),
    ],
)
def test_validation_refuses(extra: str, expected: str) -> None:
    found = problems(TREE + extra)
    assert any(expected in message for message in found), found


def test_a_parent_that_declares_overcommit_lets_a_child_have_more() -> None:
    text = TREE.replace("spec: {level: department, parent: acme}", "spec: {level: department, parent: acme, overcommit: true}")
    b = bundle(text + account_budget("dept", "research", 10) + account_budget("team", "vision", 20))
    assert {p.id for p in b.policies} == {"dept", "team"}
    # Another unit or window is another ledger: no comparison.
    assert bundle(TREE + account_budget("dept", "research", 10) + account_budget("team", "vision", 20, "{rolling_days: 7}"))


def test_a_budget_covers_a_scope_or_an_account_not_both_nor_neither() -> None:
    head = "\n---\napiVersion: budgetgate/v1\nkind: BudgetPolicy\nmetadata: {id: b}\n"
    both = TREE + head + "spec: {account: vision, scope: {namespace: vision}, window: {calendar: month}, limit: {gpu_hours: 1}}"
    neither = TREE + head + "spec: {window: {calendar: month}, limit: {gpu_hours: 1}}"
    for text in (both, neither):
        assert any("either a scope or an account" in m for m in problems(text))


def test_a_user_needs_a_scope() -> None:
    text = TREE + account("ghost", "{level: user, parent: vision}")
    assert any("a user account needs a scope" in m for m in problems(text))


RUNS = st.tuples(
    st.sampled_from(["vision", "nlp", "other"]),
    st.dictionaries(st.sampled_from(["team", "user"]), st.sampled_from(["vision", "alice", "bob"]), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(RUNS)
def test_a_run_charged_to_an_account_is_charged_to_every_budgeted_ancestor(run: tuple[str, dict[str, str]]) -> None:
    b = bundle(
        TREE
        + account_budget("org", "acme", 1000)
        + account_budget("research-month", "research", 100)
        + account_budget("vision-month", "vision", 50)
        + account_budget("alice-month", "alice", 10)
    )
    tree = b.accounts
    by_account = {p.scope.scope_id.removeprefix("account="): p for p in b.policies}
    namespace, labels = run
    charged = {account for account, policy in by_account.items() if policy.scope.matches(namespace, labels)}
    own = tree.account_of(namespace, labels)
    # Exactly the run's own account and its ancestors that have a budget: all of them or none.
    expected = set() if own is None else {a for a in [own, *tree.ancestors(own)] if a in by_account}
    assert charged == expected
