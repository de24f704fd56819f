"""The account tree the account tests share: acme, its research department, the vision team with
alice under it, and the nlp team (docs/policies.md#accounts)."""

from __future__ import annotations


def account_tree(*, vision: str = "vision", nlp: str = "nlp") -> str:
    """The tree's Account documents, vision and nlp in the namespaces given."""
    return f"""
apiVersion: budgetgate/v1
kind: Account
metadata: {{id: acme}}
spec: {{level: organisation}}
---
apiVersion: budgetgate/v1
kind: Account
metadata: {{id: research}}
spec: {{level: department, parent: acme}}
---
apiVersion: budgetgate/v1
kind: Account
metadata: {{id: vision}}
spec: {{level: team, parent: research, scope: {{namespace: {vision}, labels: {{team: vision}}}}}}
---
apiVersion: budgetgate/v1
kind: Account
metadata: {{id: alice}}
spec: {{level: user, parent: vision, scope: {{labels: {{user: alice}}}}}}
---
apiVersion: budgetgate/v1
kind: Account
metadata: {{id: nlp}}
spec: {{level: team, parent: research, scope: {{namespace: {nlp}}}}}
"""


def account_budget(policy_id: str, account: str, gpu_hours: float, window: str = "{calendar: month}") -> str:
    """A GPU-hour budget attached to `account`, as a further document."""
    return f"""
---
apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata: {{id: {policy_id}}}
spec: {{account: {account}, window: {window}, limit: {{gpu_hours: {gpu_hours}}}}}
"""
