"""The evidence-emitter: every decision and reconciliation becomes an OpenLineage RunEvent delivered to Marquez."""
