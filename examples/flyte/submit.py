"""Launch examples/flyte/workflows.py on a Flyte cluster once budgetgate admits it.

    BUDGETGATE_ADMISSION_URL=http://budgetgate-admission.budgetgate:8080 BUDGETGATE_TOKEN=… \
        python examples/flyte/submit.py                                  # the local workflow
    python examples/flyte/submit.py --launch-plan workflows.training --version v42   # a registered launch plan

The workflow must be registered first (`pyflyte register examples/flyte/workflows.py`). On DENY
or DELAY nothing is launched and the error says why (and, for DELAY, when to resubmit).
"""

from __future__ import annotations

import argparse
import sys

from flytekit.configuration import Config
from flytekit.remote import FlyteRemote

from budgetgate.client import Client
from budgetgate.adapters.flyte import BudgetDelayed, BudgetDenied, execute

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launch-plan", help="a registered launch plan to fetch and launch (default: the local workflow)")
    parser.add_argument("--version", help="its version (default: the latest)")
    args = parser.parse_args()

    remote = FlyteRemote(Config.auto(), default_project="vision", default_domain="production")
    if args.launch_plan:
        # What production launches: its projection is read from the templates FlyteAdmin holds.
        entity = remote.fetch_launch_plan(name=args.launch_plan, version=args.version)
    else:
        from workflows import training as entity
    with Client() as budgetgate:
        try:
            execution = execute(
                remote,
                entity,
                {"epochs": 10},
                client=budgetgate,
                namespace="vision-prod",
                labels={"team": "vision", "cost-center": "1042", "environment": "prod"},
            )
        except (BudgetDenied, BudgetDelayed) as refused:
            sys.exit(str(refused))
    print(f"launched {execution.id.name}")
