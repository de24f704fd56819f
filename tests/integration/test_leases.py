"""Leader election on a coordination.k8s.io/v1 Lease (budgetgate.adapters.leases) against the
stand-in API server, which refuses a write carrying a stale resourceVersion (409): one replica
leads at a time, a silent leader's Lease is taken only after its duration as the taker measures
it, the loser of a race steps down, and a released Lease is taken at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from lightkube import AsyncClient as KubeClient

from budgetgate.adapters.leases import LeaderElection
from tests.support.kube_api import KubeApi, kubeconfig
from tests.support.servers import InProcessServer, free_port
from tests.support.waiting import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def kube() -> AsyncIterator[tuple[KubeApi, KubeClient]]:
    api = KubeApi()
    server = InProcessServer(api.app, port=free_port())
    await server.start()
    client = KubeClient(kubeconfig(server.url), field_manager="budgetgate")
    yield api, client
    await client.close()
    await server.stop()


def elector(client: KubeClient, identity: str, clock: Clock, **overrides: Any) -> LeaderElection:
    settings: dict[str, Any] = {"lease_seconds": 15, "renew_deadline_seconds": 10, "retry_seconds": 2, **overrides}
    return LeaderElection(client, name="budgetgate-lifecycle", namespace="budgetgate", identity=identity, monotonic=clock, **settings)


def lease(api: KubeApi) -> dict[str, Any]:
    return api.get("leases", "budgetgate-lifecycle", "budgetgate")


async def test_one_leads_a_silent_leader_is_replaced_after_the_lease_and_steps_down(kube) -> None:  # type: ignore[no-untyped-def]
    api, client = kube
    clock = Clock()
    a, b = elector(client, "replica-a", clock), elector(client, "replica-b", clock)
    assert await a.try_acquire_or_renew() and a.leading
    assert not await b.try_acquire_or_renew() and not b.leading
    first = lease(api)
    assert (first["spec"]["holderIdentity"], first["spec"]["leaseDurationSeconds"], first["spec"]["leaseTransitions"]) == ("replica-a", 15, 0)
    assert first["spec"]["renewTime"] and first["spec"]["acquireTime"]
    clock.now += 5
    assert await a.try_acquire_or_renew()  # renewed: a new record, so b's wait starts again
    renewed = lease(api)
    assert renewed["metadata"]["resourceVersion"] != first["metadata"]["resourceVersion"]
    assert renewed["spec"]["renewTime"] >= first["spec"]["renewTime"] and renewed["spec"]["acquireTime"] == first["spec"]["acquireTime"]
    assert not await b.try_acquire_or_renew()
    clock.now += 14.9  # a silent since its renewal, but not for the lease's 15 s as b saw it
    assert not await b.try_acquire_or_renew()
    assert not a.leading  # past its renew deadline without renewing: a publishes no more
    clock.now += 0.2
    assert await b.try_acquire_or_renew() and b.leading
    taken = lease(api)
    assert (taken["spec"]["holderIdentity"], taken["spec"]["leaseTransitions"]) == ("replica-b", 1)
    assert not await a.try_acquire_or_renew() and not a.leading  # a sees b's record: it does not lead


async def test_of_two_racing_for_the_lease_one_wins_and_the_other_steps_down(kube) -> None:  # type: ignore[no-untyped-def]
    api, client = kube
    clock = Clock()
    replicas = [elector(client, f"replica-{i}", clock) for i in range(4)]
    won = await asyncio.gather(*(r.try_acquire_or_renew() for r in replicas))
    assert sum(won) == 1 and [r.leading for r in replicas] == list(won)
    assert lease(api)["spec"]["holderIdentity"] == replicas[won.index(True)].identity
    assert [m for m, _ in api.writes] == ["POST"] * 4  # all four created it; three were told AlreadyExists
    # The Lease expires for all but its holder; the others race on one resourceVersion: the API
    # server's conflict check lets exactly one write, and the holder learns it lost.
    others = [r for r, w in zip(replicas, won, strict=True) if not w]
    assert not any(await asyncio.gather(*(r.try_acquire_or_renew() for r in others)))  # each sees the holder's record now
    clock.now += 16
    before = len(api.writes)
    again = await asyncio.gather(*(r.try_acquire_or_renew() for r in others))
    assert sum(again) == 1 and [m for m, _ in api.writes[before:]] == ["PUT"] * 3
    assert lease(api)["spec"]["leaseTransitions"] == 1
    holder = replicas[won.index(True)]
    assert not await holder.try_acquire_or_renew() and not holder.leading


async def test_a_released_lease_is_taken_at_once_and_the_loop_renews(kube) -> None:  # type: ignore[no-untyped-def]
    api, client = kube
    a = LeaderElection(
        client, name="budgetgate-lifecycle", namespace="budgetgate", identity="replica-a", lease_seconds=3, renew_deadline_seconds=2, retry_seconds=0.1
    )
    b = LeaderElection(
        client, name="budgetgate-lifecycle", namespace="budgetgate", identity="replica-b", lease_seconds=3, renew_deadline_seconds=2, retry_seconds=0.1
    )
    running_a = asyncio.create_task(a.run())
    await wait_for(lambda: a.leading, timeout=10, what="a leading")
    first = lease(api)["spec"]["renewTime"]
    running_b = asyncio.create_task(b.run())
    await wait_for(lambda: lease(api)["spec"]["renewTime"] != first, timeout=10, what="a renewing")
    assert a.leading and not b.leading
    running_a.cancel()  # shutdown: a gives the Lease up
    await asyncio.gather(running_a, return_exceptions=True)
    assert not a.leading
    await wait_for(lambda: b.leading, timeout=2, what="b taking the released Lease well before its 3 s")
    assert lease(api)["spec"]["holderIdentity"] == "replica-b"
    running_b.cancel()
    await asyncio.gather(running_b, return_exceptions=True)


def test_timings_that_let_two_lead_are_refused() -> None:
    with pytest.raises(ValueError, match="a leader must give up before another replica may take the Lease"):
        LeaderElection(None, name="l", namespace="n", lease_seconds=10, renew_deadline_seconds=10, retry_seconds=2)  # type: ignore[arg-type]
