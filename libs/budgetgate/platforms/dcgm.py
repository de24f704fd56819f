"""NVIDIA DCGM exporter scrapes to cumulative GPU- and node-seconds per run, without I/O.

**What a page says.** The exporter (`dcgm-exporter`, port 9400) writes one sample per GPU and
field in the Prometheus text format, labelled with the GPU (`UUID`, `gpu`, `modelName`,
`hostname` or `Hostname`) and, when the GPU is allocated to a container, the `namespace`, `pod`
and `container` holding it (`pod_namespace`, `pod_name`, `container_name` with
`--use-old-namespace`; empty or absent when idle). A whole GPU is read from its
`DCGM_FI_DEV_GPU_UTIL` sample. A MIG instance (a sample with `GPU_I_PROFILE` and `GPU_I_ID`,
and the parent GPU's `UUID`) has no `DCGM_FI_DEV_GPU_UTIL` (DCGM does not support it on GPU
instances; some exporter versions wrote it as 0): it is read from the first of
`DCGM_FI_DEV_GPU_UTIL`, `DCGM_FI_PROF_GR_ENGINE_ACTIVE` (in the default counters, reported per
instance), `DCGM_FI_DEV_FB_USED` that has a sample for it. The exporter maps instances to pods
as it maps GPUs, by `GPU_I_ID`. A MIG instance counts as the fraction of a GPU its profile's
compute slices are of the model's (`mig_slices.py`: `3g.40gb` on an A100 is 3/7); an unknown
model or profile fails the page (ScrapeError naming it), it is never guessed.

**Shared GPUs.** With time-slicing and `--kubernetes-virtual-gpus`, the exporter copies one
GPU's sample to every pod sharing it (`vgpu` labels the replica), plus a copy naming no pod.
A GPU (or MIG instance: same `UUID` and `GPU_I_ID`) claimed by n containers' replicas is split
between them: each claim holds 1/n of it, so a pod holding one of n replicas is charged 1/n of
a GPU, not a whole one. In that mode the exporter writes no pod labels: the run ids come from
the pod looked up through the Kubernetes API (below).

**The run id** of a GPU is the first of:
- the run label (`budgetgate_io_run_id`: the pod label `budgetgate.io/run-id` as the exporter
  writes pod labels with `--kubernetes-enable-pod-labels`), then `run_id_label` (`run_id`, a
  relabel). A hashed value (`bg-…`, see run_labels.py: a run id that is no label value) is
  never the run id: it is resolved through the pod's annotation (`pod_run_id`) when the pod is
  known, else the GPU is charged to nobody and its pod named in `Holdings.unresolved`;
- the labels that name the run as the webhook and the Kueue controller do for an object without
  the label: `jobset_sigs_k8s_io_jobset_uid` (a JobSet's UID), `batch_kubernetes_io_controller_uid`
  or `controller_uid` (the Job's UID), `pod_uid` (`--kubernetes-enable-pod-uid`: the run id of a
  Pod that is a run of its own). Not for a time-sliced GPU's sample when the pod is unknown: the
  exporter then writes the pod's UID but none of its labels, so a Job's pod would be named by its
  own UID;
- else `run_id_template` filled with namespace, pod and container (`{namespace}/{pod}` by default,
  which matches no run id the webhook or controller assign).

**Pods from the Kubernetes API** (`pods`, optional): (namespace, name) → the pod object, None
when it is not found (a pod missing from the mapping was not looked up). A known pod's labels (sanitized as the exporter sanitizes them) and UID
stand in for those the page lacks, and its run label is resolved. A pod that is gone, or has
ended (phase Succeeded or Failed) while the kubelet still reports it, holds nothing: an ended
pod's GPUs are charged up to its end (the last container's `finishedAt`), not to the scrape.

What is metered is allocation, not utilization: a run holding a GPU for a second uses one
GPU-second of its budget whether it keeps the GPU busy or not (`gpu_count × runtime_hours`).
Between two scrapes a GPU held at both counts the whole interval, a GPU held at one of them
half of it (the trapezoid rule: unbiased when a run starts or ends anywhere in the interval),
and a GPU whose pod is known to have ended at a time in the interval counts up to that time;
an interval longer than `max_gap` (the exporter was unreachable) is not counted, since nothing
is known about it. Node-seconds follow the same rule over the hosts holding the run's GPUs.

A page with no sample to read GPUs from (an empty answer, the fields not collected), or where a
MIG instance has none, is a ScrapeError, as is a page that is not Prometheus text: reading it
as "no GPU held" would end every run on that node. GPUs whose sample names no pod are not
charged, and counted (`Holdings.idle`): they are idle, or the exporter does not map GPUs to pods.
Pods for which no run id can be formed are named in `Holdings.unmapped`.

One exporter failing (no answer, or a page that is a ScrapeError) does not stop the others: the
runs on the exporters that answered are metered at every scrape. For a failing exporter the rule
above is applied to that exporter alone, between its own pages: the interval from its last good
page to the next one is counted when that page comes, by the trapezoid rule, and only if it is no
longer than `max_gap`. Until then the runs on its last good page keep holding its GPUs (a run does
not look ended because its node's exporter failed, and is reported at its total so far) but are
charged nothing for that node; once that page is more than `max_gap` old, the interval can never be
counted and its holdings are dropped as gone, still charging nothing. A run on several nodes is
charged per node over each node's own intervals: while one node's exporter fails, the run's total
grows by the other nodes' share and catches up when the node answers within `max_gap`, reaching
what every exporter answering would have given, never more. Charging a failed node's last holdings
as time passes instead would charge a run that ended just after that page for time nobody saw, and
cumulative totals cannot be taken back. Pages are kept per exporter (`Meter.pages`); a state saved
before that has one page for all exporters, counted as before when every exporter answers the
first scrape after the restore, else kept uncharged until `max_gap` while each exporter starts afresh.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from budgetgate.core.metering import MAX_ID_CHARS, is_run_id
from budgetgate.platforms.mig_slices import MigProfileError, instance_share
from budgetgate.platforms.run_labels import HASHED_PREFIX, RUN_LABEL, pod_run_id

UTIL_METRIC = "DCGM_FI_DEV_GPU_UTIL"
# A MIG instance is read from the first of these with a sample for it.
MIG_METRICS = (UTIL_METRIC, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_DEV_FB_USED")
DEFAULT_RUN_ID_LABEL = "run_id"


def sanitized(label: str) -> str:
    """A Kubernetes label's name as dcgm-exporter writes it as a metric label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


RUN_LABEL_METRIC = sanitized(RUN_LABEL)  # budgetgate_io_run_id
RUN_ID_POD_LABELS = ("jobset_sigs_k8s_io_jobset_uid", "batch_kubernetes_io_controller_uid", "controller_uid", "pod_uid")
DEFAULT_RUN_ID_TEMPLATE = "{namespace}/{pod}"
_TERMINAL = frozenset({"Succeeded", "Failed"})


class ScrapeError(ValueError):
    """An exporter page that cannot say which runs hold its node's GPUs; the exporter failed, as
    one that did not answer."""


@dataclass(frozen=True)
class Claim:
    """One container's claim on a GPU or MIG instance, as one page shows it: `share` of a GPU
    (the instance's fraction of its GPU, split between the claims sharing it). A device no pod
    claims is one Claim with an empty `pod`."""

    host: str
    device: str
    share: float
    namespace: str
    pod: str
    container: str
    labels: Mapping[str, str]

    @property
    def shared(self) -> bool:
        return bool(self.labels.get("vgpu"))


def _label(labels: Mapping[str, str], *names: str) -> str:
    # dcgm-exporter has written some labels in two cases or names across versions (UUID/uuid,
    # Hostname/hostname, pod/pod_name with --use-old-namespace).
    return next((labels[n] for n in names if labels.get(n)), "")


def _device(labels: Mapping[str, str]) -> str:
    host = _label(labels, "hostname", "Hostname")
    gpu = _label(labels, "UUID", "uuid") or f"{host}/{labels.get('gpu', '')}"
    instance = labels.get("GPU_I_ID", "")
    return f"{gpu}/gi{instance}" if instance else gpu


def claims(text: str, *, page: int = 1, pages: int = 1, mig_slices: Mapping[str, int] | None = None) -> list[Claim]:
    """Every claim on a GPU that one exporter page shows.

    Raises ScrapeError (a ValueError) when the page is not Prometheus text, has no sample to read
    GPUs from, has a MIG instance without one, or a MIG instance of an unknown model or profile."""
    where = "the exporter page" if pages == 1 else f"exporter page {page} of {pages}"
    by_metric: dict[str, dict[str, list[Mapping[str, str]]]] = {metric: {} for metric in MIG_METRICS}
    instances: dict[str, Mapping[str, str]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                device = _device(sample.labels)
                if sample.labels.get("GPU_I_ID") and _label(sample.labels, "UUID", "uuid"):
                    instances.setdefault(device, sample.labels)
                if family.name in by_metric:
                    by_metric[family.name].setdefault(device, []).append(sample.labels)
    except ValueError as exc:
        raise ScrapeError(f"{where} is not Prometheus text ({exc})") from exc
    devices = {device: samples for device, samples in by_metric[UTIL_METRIC].items() if device not in instances}
    for device in instances:
        found = next((by_metric[metric][device] for metric in MIG_METRICS if device in by_metric[metric]), None)
        if found is None:
            raise ScrapeError(
                f"{where} has no sample of {', '.join(MIG_METRICS)} for the MIG instance {device}: "
                "it cannot say which run holds it (collect DCGM_FI_PROF_GR_ENGINE_ACTIVE)"
            )
        devices[device] = found
    if not devices:
        why = "it is empty" if not text.strip() else "the exporter does not collect that field"
        raise ScrapeError(f"{where} has no {UTIL_METRIC} sample ({why}), nor a MIG instance's: it cannot say which runs hold its GPUs")
    found_claims: list[Claim] = []
    for device, samples in devices.items():
        first = samples[0]
        share = 1.0
        if device in instances:
            try:
                share = instance_share(_label(first, "modelName", "model_name"), first.get("GPU_I_PROFILE", ""), mig_slices)
            except MigProfileError as exc:
                raise ScrapeError(f"{where}: {exc}") from exc
        host = _label(first, "hostname", "Hostname")
        # One claim per container and replica naming a pod; the exporter's copy naming none
        # (time-slicing) claims nothing beside them.
        named: dict[tuple[str, ...], Mapping[str, str]] = {}
        for labels in samples:
            pod = _label(labels, "pod", "pod_name")
            if pod:
                key = (_label(labels, "namespace", "pod_namespace"), pod, _label(labels, "container", "container_name"), labels.get("vgpu", ""))
                named.setdefault(key, labels)
        if not named:
            found_claims.append(Claim(host, device, share, "", "", "", first))
            continue
        for (namespace, pod, container, _), labels in named.items():
            found_claims.append(Claim(host, device, share / len(named), namespace, pod, container, labels))
    return found_claims


@dataclass(frozen=True)
class Holding:
    """What one run held at one scrape: `gpus`, each GPU or MIG instance (by UUID, `/gi<id>` for
    an instance) → the share of one GPU it held; the hosts holding them; and what its pods that
    ended still show (`ended`: device → (share, when the pod ended); `ended_hosts`: host → the
    latest end there, for hosts where the run holds nothing else)."""

    gpus: Mapping[str, float]
    hosts: frozenset[str]
    ended: Mapping[str, tuple[float, datetime]] = field(default_factory=dict)
    ended_hosts: Mapping[str, datetime] = field(default_factory=dict)

    @property
    def gpu_count(self) -> float:
        return sum(self.gpus.values())


class Holdings(dict[str, Holding]):
    """Which run holds which GPUs at one scrape (run id → Holding); `idle`: GPUs whose sample
    names no pod; `unmapped`: pods (`namespace/pod`) holding GPUs that no run id was formed for;
    `unresolved`: pods whose hashed run label could not be resolved to a run id (the reason in
    `why`); `gone`: pods the kubelet still reports that are deleted or ended."""

    def __init__(
        self,
        held: Mapping[str, Holding] | None = None,
        *,
        idle: int = 0,
        unmapped: Iterable[str] = (),
        unresolved: Mapping[str, str] | None = None,
        gone: Iterable[str] = (),
    ) -> None:
        super().__init__(held or {})
        self.idle = idle
        self.unmapped = frozenset(unmapped)
        self.why = dict(unresolved or {})
        self.unresolved = frozenset(self.why)
        self.gone = frozenset(gone)


@dataclass(frozen=True)
class _Unresolved:
    why: str


def pod_labels(pod: Mapping[str, Any]) -> dict[str, str]:
    """A pod's labels as dcgm-exporter would write them on its GPUs' samples, with its UID."""
    meta = pod.get("metadata") or {}
    labels = {sanitized(name): str(value) for name, value in (meta.get("labels") or {}).items()}
    if meta.get("uid"):
        labels["pod_uid"] = str(meta["uid"])
    return labels


def pod_end(pod: Mapping[str, Any]) -> tuple[bool, datetime | None]:
    """Whether the pod has ended (phase Succeeded or Failed) and when: its containers' latest
    `finishedAt` (None when no container says)."""
    status = pod.get("status") or {}
    if status.get("phase") not in _TERMINAL:
        return False, None
    ends = [
        datetime.fromisoformat(str(terminated["finishedAt"]).replace("Z", "+00:00"))
        for container in status.get("containerStatuses") or []
        if (terminated := (container.get("state") or {}).get("terminated")) and terminated.get("finishedAt")
    ]
    return True, max(ends) if ends else None


def _run_id(claim: Claim, pod: Mapping[str, Any] | None, *, run_id_label: str, pod_run_id_labels: Iterable[str], known: bool) -> str | _Unresolved | None:
    labels = {**pod_labels(pod), **claim.labels} if pod is not None else dict(claim.labels)
    for name in (RUN_LABEL_METRIC, run_id_label):
        value = labels.get(name)
        if not value:
            continue
        if not value.startswith(HASHED_PREFIX):
            return value
        if pod is None:
            return _Unresolved(
                f"its run label {value} is a hash and the pod is not looked up through the Kubernetes API"
                if not known
                else f"its run label {value} is a hash and the pod is not found"
            )
        whole = pod_run_id(pod)
        return whole if whole else _Unresolved(f"its run label {value} is a hash and its annotation {RUN_LABEL} is missing or does not hash to it")
    if claim.shared and pod is None:
        return None  # a time-sliced GPU's sample has the pod's UID but none of its labels
    return next((labels[name] for name in pod_run_id_labels if labels.get(name)), None)


def holdings(
    texts: Iterable[str],
    *,
    run_id_label: str = DEFAULT_RUN_ID_LABEL,
    run_id_template: str | None = DEFAULT_RUN_ID_TEMPLATE,
    pod_run_id_labels: Iterable[str] = RUN_ID_POD_LABELS,
    pods: Mapping[tuple[str, str], Mapping[str, Any] | None] | None = None,
    mig_slices: Mapping[str, int] | None = None,
) -> Holdings:
    """Which run holds which GPUs, from the exposition texts of one scrape of every exporter
    (`run_id_template` None: only GPUs whose sample names a run count; `pods`: the pods named
    on the pages, looked up through the Kubernetes API, None where not found).

    Raises ScrapeError (a ValueError) for a page `claims` cannot read."""
    pages = list(texts)
    found = [c for page, text in enumerate(pages, start=1) for c in claims(text, page=page, pages=len(pages), mig_slices=mig_slices)]
    return holdings_of(found, run_id_label=run_id_label, run_id_template=run_id_template, pod_run_id_labels=pod_run_id_labels, pods=pods)


def holdings_of(
    found: Iterable[Claim],
    *,
    run_id_label: str = DEFAULT_RUN_ID_LABEL,
    run_id_template: str | None = DEFAULT_RUN_ID_TEMPLATE,
    pod_run_id_labels: Iterable[str] = RUN_ID_POD_LABELS,
    pods: Mapping[tuple[str, str], Mapping[str, Any] | None] | None = None,
) -> Holdings:
    """Which run holds which GPUs, from the claims of one scrape (see `holdings`)."""
    rest = tuple(pod_run_id_labels)
    gpus: dict[str, dict[str, float]] = {}
    hosts: dict[str, set[str]] = {}
    ended: dict[str, dict[str, tuple[float, datetime]]] = {}
    ended_at: dict[str, dict[str, datetime]] = {}
    idle, unmapped, unresolved, gone = 0, set(), {}, set()
    for claim in found:
        if not claim.pod:
            idle += 1  # nobody is charged for it
            continue
        name = f"{claim.namespace}/{claim.pod}"
        looked_up = pods is not None and (claim.namespace, claim.pod) in pods
        pod = pods.get((claim.namespace, claim.pod)) if pods is not None else None
        if looked_up and pod is None:
            gone.add(name)  # deleted: the kubelet still reports it for a while
            continue
        run_id = _run_id(claim, pod, run_id_label=run_id_label, pod_run_id_labels=rest, known=looked_up)
        if isinstance(run_id, _Unresolved):
            unresolved[name] = run_id.why
            continue
        if run_id is None:
            if run_id_template is None:
                unmapped.add(name)
                continue
            run_id = run_id_template.format(namespace=claim.namespace, pod=claim.pod, container=claim.container)
        # A sample of a run id metering-ingest refuses would be refused, and with it every
        # sample of the same publish.
        if not is_run_id(run_id):
            unresolved[name] = f"its run id {run_id!r} is not one metering-ingest accepts (1-{MAX_ID_CHARS} printable ASCII characters, no spaces)"
            continue
        over, end = pod_end(pod) if pod is not None else (False, None)
        if over:
            gone.add(name)
            if end is not None:
                share, _ = ended.setdefault(run_id, {}).get(claim.device, (0.0, end))
                ended[run_id][claim.device] = (share + claim.share, end)
                last = ended_at.setdefault(run_id, {}).get(claim.host)
                ended_at[run_id][claim.host] = end if last is None else max(last, end)
            continue
        held = gpus.setdefault(run_id, {})
        held[claim.device] = held.get(claim.device, 0.0) + claim.share
        hosts.setdefault(run_id, set()).add(claim.host)
    result = {
        run_id: Holding(
            gpus.get(run_id, {}),
            frozenset(hosts.get(run_id, ())),
            ended.get(run_id, {}),
            {host: end for host, end in ended_at.get(run_id, {}).items() if host not in hosts.get(run_id, ())},
        )
        for run_id in set(gpus) | set(ended)
    }
    return Holdings(result, idle=idle, unmapped=unmapped, unresolved=unresolved, gone=gone)


def pods_named(found: Iterable[Claim]) -> set[tuple[str, str]]:
    """The pods (namespace, name) that claims name: those to look up (not a pod without a
    namespace, which an exporter writing no namespace would name: no lookup could find it)."""
    return {(c.namespace, c.pod) for c in found if c.pod and c.namespace}


@dataclass(frozen=True)
class Usage:
    """A run's GPU- and node-seconds since the meter first saw it (cumulative)."""

    run_id: str
    observed_at: datetime
    gpu_seconds: float
    node_seconds: float


EVERY_EXPORTER = "*"  # the page of a state saved before pages were kept per exporter: all of them at once
_NONE_HELD = Holding({}, frozenset())


@dataclass(frozen=True)
class Page:
    """An exporter's last page that could be read: when, and which run held which of its GPUs."""

    at: datetime
    held: Mapping[str, Holding]


@dataclass
class Meter:
    """Folds successive scrapes into each run's cumulative seconds; its state (`totals`, each
    exporter's last good page) can be saved and restored so a restarted meter does not count from zero.

    `last` is what each run holds as far as the meter knows: the union of those pages."""

    max_gap: timedelta = timedelta(minutes=5)
    totals: dict[str, tuple[float, float]] = field(default_factory=dict)
    last_at: datetime | None = None
    last: dict[str, Holding] = field(default_factory=dict)
    pages: dict[str, Page] = field(default_factory=dict)

    def observe(self, at: datetime, pages: Mapping[str, Mapping[str, Holding] | None]) -> list[Usage]:
        """Count, for every exporter that answered (exporter → what its page holds; None: its page
        failed), the interval since its last good page; the cumulative usage of every run held at
        either end of it (a run that ended is reported once more). Totals are kept for runs no
        longer held, so a run that holds GPUs again (re-admitted) goes on from its total.
        A scrape in which no exporter answered changes nothing."""
        if self.last_at is not None and at <= self.last_at:
            raise ValueError(f"scrape at {at.isoformat()} is not after the previous one ({self.last_at.isoformat()})")
        answered = {exporter: held for exporter, held in pages.items() if held is not None}
        if not answered:
            return []
        for since, before, after in self._intervals(answered, every=len(answered) == len(pages)):
            self._count(since, at, before, after)
        self.pages.update({exporter: Page(at, _holding(held)) for exporter, held in answered.items()})
        # A page older than max_gap ends an interval that can no longer be counted: its holdings are gone.
        self.pages = {exporter: page for exporter, page in self.pages.items() if at - page.at <= self.max_gap}
        held_before, self.last_at, self.last = self.last, at, _union(page.held for page in self.pages.values())
        ending = {run_id for held in answered.values() for run_id, h in held.items() if h.ended}
        return [Usage(run_id, at, *self.totals.setdefault(run_id, (0.0, 0.0))) for run_id in sorted(set(held_before) | set(self.last) | ending)]

    def _intervals(self, answered: Mapping[str, Mapping[str, Holding]], *, every: bool) -> list[tuple[datetime, dict[str, Holding], dict[str, Holding]]]:
        """The intervals this scrape ends, one per time its answering exporters last answered:
        (that time, what their pages held then, what they hold now). An exporter never read
        before ends none."""
        legacy = self.pages.get(EVERY_EXPORTER)
        if legacy is not None and every and len(self.pages) == 1:
            del self.pages[EVERY_EXPORTER]
            return [(legacy.at, dict(legacy.held), _union(answered.values(), ended=True))]
        since: dict[datetime, list[str]] = {}
        for exporter in answered:
            if exporter in self.pages:
                since.setdefault(self.pages[exporter].at, []).append(exporter)
        return [
            (then, _union(self.pages[e].held for e in exporters), _union((answered[e] for e in exporters), ended=True)) for then, exporters in since.items()
        ]

    def _count(self, since: datetime, at: datetime, before: Mapping[str, Holding], after: Mapping[str, Holding]) -> None:
        seconds = (at - since).total_seconds()
        if seconds > self.max_gap.total_seconds():
            return  # nothing is known about it
        for run_id in set(before) | set(after):
            held_before, held_after = before.get(run_id, _NONE_HELD), after.get(run_id, _NONE_HELD)
            gpu, node = self.totals.get(run_id, (0.0, 0.0))
            gpu += _held_for(seconds, since, held_before.gpus, held_after.gpus, held_after.ended)
            node += _held_for(
                seconds,
                since,
                dict.fromkeys(held_before.hosts, 1.0),
                dict.fromkeys(held_after.hosts, 1.0),
                {host: (1.0, end) for host, end in held_after.ended_hosts.items()},
            )
            self.totals[run_id] = (gpu, node)

    def state(self) -> dict[str, object]:
        """What to save between runs of the meter (JSON-ready; `last` too, so a meter of an
        earlier version still reads it)."""
        return {
            "last_at": self.last_at.isoformat() if self.last_at else None,
            "totals": {run: list(t) for run, t in self.totals.items()},
            "last": _held_state(self.last),
            "pages": {exporter: {"at": page.at.isoformat(), "held": _held_state(page.held)} for exporter, page in self.pages.items()},
        }

    @classmethod
    def restored(cls, state: Mapping[str, object], *, max_gap: timedelta) -> Meter:
        """A meter continuing from `state()`, or from the state of a meter that kept no pages
        per exporter (its `last` becomes the page of every exporter at `last_at`)."""
        last_at = datetime.fromisoformat(state["last_at"]) if isinstance(state.get("last_at"), str) else None  # type: ignore[arg-type]
        totals = state.get("totals") or {}
        saved = state.get("pages")
        if isinstance(saved, Mapping):
            pages = {exporter: Page(datetime.fromisoformat(page["at"]), _held(page["held"])) for exporter, page in saved.items()}
        else:
            pages = {EVERY_EXPORTER: Page(last_at, _held(state.get("last") or {}))} if last_at is not None else {}
        return cls(
            max_gap=max_gap,
            totals={run: (float(t[0]), float(t[1])) for run, t in totals.items()},  # type: ignore[union-attr]
            last_at=last_at,
            last=_union(page.held for page in pages.values()),
            pages=pages,
        )


def _held_for(seconds: float, since: datetime, before: Mapping[str, float], after: Mapping[str, float], ended: Mapping[str, tuple[float, datetime]]) -> float:
    """The share-seconds of one interval of `seconds` from `since`: held at both ends, the mean
    of the two shares over all of it; at one end, half of it; and what a pod that ended in it
    held, up to its end (half that when it was not held at the start either)."""
    total = 0.0
    for key in before.keys() | after.keys() | ended.keys():
        if key in after:
            total += (before.get(key, 0.0) + after[key]) / 2 * seconds
        elif key in ended:
            share, end = ended[key]
            until = min(max((end - since).total_seconds(), 0.0), seconds)
            total += before[key] * until if key in before else share * until / 2
        else:
            total += before[key] * seconds / 2
    return total


def _holding(held: Mapping[str, Holding]) -> dict[str, Holding]:
    """What a page keeps for the next interval: what runs still hold (what ended is counted once)."""
    return {run_id: Holding(h.gpus, h.hosts) for run_id, h in held.items() if h.gpus}


def _union(pages: Iterable[Mapping[str, Holding]], *, ended: bool = False) -> dict[str, Holding]:
    """What each run holds on any of `pages` (and, with `ended`, what ended there)."""
    union: dict[str, Holding] = {}
    for page in pages:
        for run_id, held in page.items():
            if not held.gpus and not (ended and held.ended):
                continue
            known = union.get(run_id, _NONE_HELD)
            union[run_id] = Holding(
                {**known.gpus, **held.gpus},
                known.hosts | held.hosts,
                {**known.ended, **held.ended} if ended else {},
                {**known.ended_hosts, **held.ended_hosts} if ended else {},
            )
    return union


def _held_state(held: Mapping[str, Holding]) -> dict[str, object]:
    return {run: {"gpus": dict(sorted(h.gpus.items())), "hosts": sorted(h.hosts)} for run, h in held.items()}


def _held(state: object) -> dict[str, Holding]:
    # A state of before GPUs had shares lists them: each a whole GPU.
    return {
        run: Holding(dict(h["gpus"]) if isinstance(h["gpus"], Mapping) else dict.fromkeys(h["gpus"], 1.0), frozenset(h["hosts"]))
        for run, h in state.items()  # type: ignore[attr-defined]
    }


def sample_id(exporter: str, at: datetime) -> str:
    """The id of the sample a meter sends for a run at one scrape: the same on a resend."""
    return f"{exporter}@{int(at.timestamp() * 1000)}"
