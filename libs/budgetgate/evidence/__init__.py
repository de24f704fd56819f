"""The evidence of decisions and reconciliations: the `budget` run facet (`facet`), the
OpenLineage events that carry it (`events`), the evidence store in Postgres (`store`), and the
audit figures from the store's views or from Marquez (`audit`). The evidence-emitter builds and
sends events with them; `budgetgate audit` and `budgetgate evidence` read with them."""
