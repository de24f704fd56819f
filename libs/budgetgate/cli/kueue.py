"""`budgetgate kueue admission-check`: run the Kueue AdmissionCheck controller
(`controllerName: budgetgate.io/budget`) against the cluster's API server."""

from __future__ import annotations

import asyncio
import logging

import click


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
def admission_check(kubeconfig: str | None, admission_url: str | None, default_runtime_hours: float | None, requeue_seconds: float) -> None:
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
            mapping = Mapping(default_runtime_hours=default_runtime_hours)
            await AdmissionCheckController(kube=kube, budgetgate=budgetgate, mapping=mapping, requeue_seconds=requeue_seconds).run()

    asyncio.run(run())
