"""What the ledger says, read from Postgres for people: budgets and usage by scope, tenant or
user (`budgets`, `usage`), a run's status (`status`), and the what-if report over the recorded
history (`history`, `whatif`). Admission's read routes and the command line both answer with them."""
