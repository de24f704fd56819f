"""`budgetgate kubernetes lifecycle`: run the lifecycle controller (budgetgate/adapters/
lifecycle_controller.py) against the cluster's API server, publishing to metering-ingest, with
leader election on a Lease so that several replicas may run and one publishes."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import click

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _own_namespace() -> str | None:
    """The namespace this pod runs in: POD_NAMESPACE (the downward API), else the service account's."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None


@click.group()
def kubernetes() -> None:
    """Kubernetes integration."""


@kubernetes.command("lifecycle")
@click.option(
    "--kubeconfig", type=click.Path(exists=True, dir_okay=False), default=None, help="A kubeconfig file (default: in-cluster, else KUBECONFIG, ~/.kube/config)."
)
@click.option("--metering-url", default=None, help="metering-ingest's URL (default: BUDGETGATE_METERING_URL, else the local stack's).")
@click.option(
    "--admission-check", "admission_checks", multiple=True, default=("budget",), show_default=True,
    help="An AdmissionCheck of budgetgate's (Workloads carrying one are followed); repeat for several.",
)  # fmt: skip
@click.option("--lease-name", default="budgetgate-lifecycle", show_default=True, help="The coordination.k8s.io/v1 Lease the replicas elect their leader on.")
@click.option("--lease-namespace", default=None, help="The Lease's namespace (default: POD_NAMESPACE, else the service account's namespace).")
@click.option("--identity", default=None, help="This replica's holder identity (default: the pod's name and a random suffix).")
@click.option("--lease-seconds", type=click.IntRange(min=2), default=15, show_default=True, help="leaseDurationSeconds: how long a silent leader keeps it.")
@click.option(
    "--renew-deadline",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds a leader may fail to renew before it stops publishing.",
)
@click.option(
    "--retry-seconds", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True, help="Seconds between tries to acquire or renew the Lease."
)
@click.option("--no-leader-election", is_flag=True, help="Publish without a Lease (one replica only).")
def lifecycle(
    kubeconfig: str | None, metering_url: str | None, admission_checks: tuple[str, ...], lease_name: str, lease_namespace: str | None,
    identity: str | None, lease_seconds: int, renew_deadline: float, retry_seconds: float, no_leader_election: bool,
) -> None:  # fmt: skip
    """Publish STORED, STARTED, EVICTED, READMITTED and the end of every run budgetgate admitted on
    this cluster (pods with the run label, their Jobs, Kueue Workloads of budgetgate's checks), until stopped."""
    from lightkube import AsyncClient as KubeClient
    from lightkube import KubeConfig

    from budgetgate.adapters.leases import LeaderElection
    from budgetgate.adapters.lifecycle_controller import LifecycleController
    from budgetgate.client import AsyncClient

    namespace = lease_namespace or _own_namespace()
    if not no_leader_election and not namespace:
        raise click.UsageError("no namespace for the Lease: pass --lease-namespace (or run in a pod, or set POD_NAMESPACE), or --no-leader-election")
    if not no_leader_election and not 0 < retry_seconds < renew_deadline < lease_seconds:
        raise click.UsageError("need --retry-seconds < --renew-deadline < --lease-seconds: a leader must stop before another may take the Lease")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        kube = KubeClient(KubeConfig.from_file(kubeconfig) if kubeconfig else None, field_manager="budgetgate")
        try:
            async with AsyncClient(metering_url=metering_url) as budgetgate:
                if budgetgate.metering_url is None:
                    raise click.UsageError("no metering-ingest URL: pass --metering-url or set BUDGETGATE_METERING_URL")
                election = None
                if not no_leader_election:
                    assert namespace is not None
                    election = LeaderElection(
                        kube, name=lease_name, namespace=namespace, identity=identity, lease_seconds=lease_seconds,
                        renew_deadline_seconds=renew_deadline, retry_seconds=retry_seconds,
                    )  # fmt: skip
                controller = LifecycleController(
                    kube=kube, publish=lambda events: budgetgate.publish_lifecycle(*events), election=election, admission_checks=frozenset(admission_checks)
                )
                await controller.run()
        finally:
            await kube.close()

    asyncio.run(run())
