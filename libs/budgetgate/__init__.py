"""budgetgate: admission-time GPU budget enforcement with budgets as code."""
