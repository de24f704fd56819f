"""The admission API's routes, a module per what they serve: submissions, their decisions, usage
by scope and token pools (admissions.py), quotes and explanations (quotes.py), policy bundles
(bundles.py), a tenant's settings (tenants.py), usage by tenant and user (usage.py), the budgets
(budgets.py), the grants to them (grants.py), chargeback reports (reports.py), the read-only page
for tenants and finance (ui.py) and the Kubernetes admission webhooks (kubernetes.py validating,
and kubernetes_mutation.py naming the run before it). Each finds the running service as
`request.app.state.rt` (budgetgate.services.admission.service.AdmissionService)."""

from __future__ import annotations

from fastapi import APIRouter

from budgetgate.services.admission.routes import (
    admissions,
    budgets,
    bundles,
    grants,
    kubernetes,
    kubernetes_mutation,
    quotes,
    reports,
    tenants,
    ui,
    usage,
)
from budgetgate.services.admission.settings import AdmissionSettings

OPERATIONS = quotes.OPERATIONS


def routers(settings: AdmissionSettings, *, kubernetes_webhook: kubernetes.KubernetesWebhookSettings) -> list[APIRouter]:
    """Every router of the admission API, in the order they are matched."""
    return [
        # Before admissions.router: its GET /v1/admissions/{run_id:path} would take .../explain too.
        quotes.router,
        admissions.router,
        bundles.router,
        tenants.router,
        kubernetes.router(kubernetes_webhook),
        kubernetes_mutation.router(kubernetes_webhook),
        usage.router(settings),
        budgets.router,
        reports.router(settings),
        grants.router,
        ui.router,
    ]
