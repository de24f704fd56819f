"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it, with
lightkube: of the replicas that run it, one leads at a time.

- **Acquire.** A replica reads the Lease; none yet, it creates it naming itself (`holderIdentity`,
  `leaseDurationSeconds`, `acquireTime`, `renewTime`, `leaseTransitions` 0). A Lease held by
  another is taken only once that holder's record has not changed for `leaseDurationSeconds` as
  *this* replica's clock measures (the time it observed the record, not the `renewTime` written in
  it: the replicas' clocks need not agree). Taking it raises `leaseTransitions`.
- **Renew.** The leader writes `renewTime` every `retry_seconds`. Every write is a PUT carrying the
  resourceVersion read, so of two replicas racing for the Lease the API server lets one win
  (409 Conflict for the other).
- **Step down.** A leader that cannot renew for `renew_deadline_seconds` (shorter than the lease,
  so it stops before another may take over), or finds the Lease held by another, stops leading at
  once; on shutdown it gives the Lease up (`release`: no holder), so another takes over without
  waiting out the lease.

`leading` says whether this replica leads now; `changed` is set at each change of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from lightkube import ApiError
from lightkube import AsyncClient as KubeClient
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

log = logging.getLogger(__name__)


def default_identity() -> str:
    """The pod's name (HOSTNAME) and a random suffix: unique even across restarts of one pod."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class LeaderElection:
    """One replica's part in the election on Lease `namespace`/`name`."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        name: str,
        namespace: str,
        identity: str | None = None,
        lease_seconds: int = 15,
        renew_deadline_seconds: float = 10.0,
        retry_seconds: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if not name or not namespace:
            raise ValueError("a leader election needs the Lease's name and namespace")
        if lease_seconds < 1:
            raise ValueError(f"lease_seconds must be at least 1, not {lease_seconds}")
        if not 0 < retry_seconds < renew_deadline_seconds < lease_seconds:
            raise ValueError(
                f"need 0 < retry_seconds ({retry_seconds}) < renew_deadline_seconds ({renew_deadline_seconds}) < lease_seconds ({lease_seconds}): "
                "a leader must give up before another replica may take the Lease"
            )
        self.kube = kube
        self.name, self.namespace = name, namespace
        self.identity = identity or default_identity()
        self.lease_seconds = lease_seconds
        self.renew_deadline_seconds = renew_deadline_seconds
        self.retry_seconds = retry_seconds
        self.monotonic, self.wall = monotonic, wall
        self.changed = asyncio.Event()
        self._leading = False
        self._renewed = 0.0  # monotonic time of the last successful acquire or renewal
        self._observed: tuple[object, ...] | None = None  # the Lease record as last read
        self._observed_at = 0.0  # monotonic time it was first read as it is

    @property
    def leading(self) -> bool:
        """Leading now: renewed within the renew deadline, and not stepped down."""
        return self._leading and self.monotonic() - self._renewed < self.renew_deadline_seconds

    async def try_acquire_or_renew(self) -> bool:
        """One round: create, take over or renew the Lease; whether this replica holds it now.
        A conflict (another replica wrote first) is a lost round, not an error; API errors raise."""
        now = self.wall()
        try:
            lease = await self.kube.get(Lease, self.name, namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
            fresh = Lease(
                metadata=ObjectMeta(name=self.name, namespace=self.namespace),
                spec=LeaseSpec(holderIdentity=self.identity, leaseDurationSeconds=self.lease_seconds, acquireTime=now, renewTime=now, leaseTransitions=0),
            )
            return await self._write(fresh, create=True)
        spec = lease.spec or LeaseSpec()
        record = (spec.holderIdentity, spec.renewTime, spec.acquireTime, spec.leaseDurationSeconds, spec.leaseTransitions)
        if record != self._observed:
            self._observed, self._observed_at = record, self.monotonic()
        holder = spec.holderIdentity or ""
        if holder and holder != self.identity:
            duration = spec.leaseDurationSeconds or self.lease_seconds
            if self.monotonic() < self._observed_at + duration:
                self._step_down(f"the Lease is held by {holder!r}")
                return False
            log.info("lease %s/%s of %r expired (no renewal seen for %ss): taking it", self.namespace, self.name, holder, duration)
        ours = holder == self.identity
        lease.spec = LeaseSpec(
            holderIdentity=self.identity,
            leaseDurationSeconds=self.lease_seconds,
            acquireTime=spec.acquireTime if ours and spec.acquireTime else now,
            renewTime=now,
            leaseTransitions=(spec.leaseTransitions or 0) + (0 if ours or not holder else 1),
        )
        return await self._write(lease, create=False)

    async def _write(self, lease: Lease, *, create: bool) -> bool:
        try:
            written = await (self.kube.create(lease) if create else self.kube.replace(lease))
        except ApiError as exc:
            if exc.status.code == 409:  # another replica created or wrote it first
                self._step_down("another replica wrote the Lease first")
                return False
            raise
        spec = written.spec or LeaseSpec()
        self._observed = (spec.holderIdentity, spec.renewTime, spec.acquireTime, spec.leaseDurationSeconds, spec.leaseTransitions)
        self._observed_at = self._renewed = self.monotonic()
        if not self._leading:
            self._leading = True
            self.changed.set()
            log.info("%s leads (lease %s/%s)", self.identity, self.namespace, self.name)
        return True

    def _step_down(self, why: str) -> None:
        if self._leading:
            self._leading = False
            self.changed.set()
            log.warning("%s stopped leading: %s", self.identity, why)

    async def run(self) -> None:
        """Acquire and renew for ever (every `retry_seconds`), stepping down when renewing fails
        past the renew deadline; until cancelled, when the Lease is given up."""
        try:
            while True:
                try:
                    await self.try_acquire_or_renew()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the API server away, a connection cut: tried again
                    log.warning("lease %s/%s: %s: %s", self.namespace, self.name, type(exc).__name__, exc)
                if self._leading and not self.leading:
                    self._step_down(f"not renewed for {self.renew_deadline_seconds}s")
                await asyncio.sleep(self.retry_seconds)
        finally:
            await self.release()

    async def release(self) -> None:
        """Give the Lease up if this replica holds it (holder cleared), so another need not wait
        out the lease; a failure only means the others wait it out."""
        if not self._leading:
            return
        self._step_down("releasing the Lease")
        try:
            lease = await self.kube.get(Lease, self.name, namespace=self.namespace)
            if lease.spec is not None and lease.spec.holderIdentity == self.identity:
                lease.spec.holderIdentity = None
                lease.spec.leaseDurationSeconds = 1
                await self.kube.replace(lease)
        except Exception as exc:  # noqa: BLE001 - the API server away: the others wait the lease out
            log.warning("lease %s/%s not released (%s): the next leader waits it out", self.namespace, self.name, exc)
