"""Launch examples/flyte/workflows.py on a Flyte cluster once budgetgate admits it.

    BUDGETGATE_ADMISSION_URL=http://budgetgate-admission.budgetgate:8080 BUDGETGATE_TOKEN=… \
        python examples/flyte/submit.py

The workflow must be registered first (`pyflyte register examples/flyte/workflows.py`). On DENY
or DELAY nothing is launched and the error says why (and, for DELAY, when to resubmit).
"""

from __future__ import annotations

import sys

from flytekit.configuration import Config
from flytekit.remote import FlyteRemote

from budgetgate.client import Client
from budgetgate.adapters.flyte import BudgetDelayed, BudgetDenied, execute

if __name__ == "__main__":
    from workflows import training

    remote = FlyteRemote(Config.auto(), default_project="vision", default_domain="production")
    with Client() as budgetgate:
        try:
            execution = execute(
                remote,
                training,
                {"epochs": 10},
                client=budgetgate,
                namespace="vision-prod",
                labels={"team": "vision", "cost-center": "1042", "environment": "prod"},
            )
        except (BudgetDenied, BudgetDelayed) as refused:
            sys.exit(str(refused))
    print(f"launched {execution.id.name}")
