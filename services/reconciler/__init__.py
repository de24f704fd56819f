"""The reconciler: lifecycle facts and usage records replace reservations with actuals on the ledger, and keep Redis in line with Postgres."""
