"""`budgetgate kueue admission-check`: run the Kueue AdmissionCheck controller
(`controllerName: budgetgate.io/budget`) against the cluster's API server."""

from __future__ import annotations

import asyncio
import logging

import click

from budgetgate.adapters.kueue_workloads import MAX_REQUEUE_SECONDS, Retries


@click.group()
def kueue() -> None:
    """Kueue integration."""


@kueue.command("admission-check")
@click.option(
    "--kubeconfig",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A kubeconfig file (default: in-cluster, else KUBECONFIG / ~/.kube/config).",
)
@click.option("--admission-url", default=None, help="budgetgate admission's URL (default: BUDGETGATE_ADMISSION_URL, else the local stack's).")
@click.option(
    "--default-runtime-hours",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Hours assumed for Workloads without maximumExecutionTimeSeconds or the runtime annotation.",
)
@click.option(
    "--requeue-seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds between listings of the Workloads still waiting on the check, decided again (a watch brings no event for one left undecided).",
)
@click.option(
    "--submit-cpu-only/--no-submit-cpu-only",
    default=False,
    show_default=True,
    help="Submit Workloads asking for no GPU (as 0 GPUs, charged on node-hour and wall-hour budgets) instead of letting them through undecided.",
)
@click.option(
    "--quota-retry-seconds",
    type=click.IntRange(min=1, max=MAX_REQUEUE_SECONDS),
    default=Retries.quota_seconds,
    show_default=True,
    help="requeueAfterSeconds of a Retry for a concurrency limit (tenant quota, sensitive pool, token pool) that is full now.",
)
@click.option(
    "--outage-retry-seconds",
    type=click.IntRange(min=1, max=MAX_REQUEUE_SECONDS),
    default=Retries.outage_seconds,
    show_default=True,
    help="requeueAfterSeconds of a Retry when budgetgate cannot decide (503, 429, unreachable); a longer Retry-After wins.",
)
@click.option(
    "--delay-retry-seconds",
    type=click.IntRange(min=1, max=MAX_REQUEUE_SECONDS),
    default=Retries.delay_seconds,
    show_default=True,
    help="requeueAfterSeconds of a Retry for a DELAY whose budgets name no next eligible time (otherwise: until that time).",
)
def admission_check(
    kubeconfig: str | None,
    admission_url: str | None,
    default_runtime_hours: float | None,
    requeue_seconds: float,
    submit_cpu_only: bool,
    quota_retry_seconds: int,
    outage_retry_seconds: int,
    delay_retry_seconds: int,
) -> None:
    """Decide every Workload that waits on budgetgate's AdmissionCheck, until stopped."""
    from lightkube import AsyncClient as KubeClient
    from lightkube import KubeConfig

    from budgetgate.client import AsyncClient
    from budgetgate.adapters.kueue_controller import AdmissionCheckController
    from budgetgate.platforms.kubernetes import Mapping

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        kube = KubeClient(KubeConfig.from_file(kubeconfig) if kubeconfig else None, field_manager="budgetgate")
        async with AsyncClient(admission_url) as budgetgate:
            mapping = Mapping(default_runtime_hours=default_runtime_hours, submit_cpu_only=submit_cpu_only)
            retries = Retries(quota_seconds=quota_retry_seconds, outage_seconds=outage_retry_seconds, delay_seconds=delay_retry_seconds)
            controller = AdmissionCheckController(kube=kube, budgetgate=budgetgate, mapping=mapping, requeue_seconds=requeue_seconds, retries=retries)
            await controller.run()

    asyncio.run(run())
