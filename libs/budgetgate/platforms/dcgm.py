"""NVIDIA DCGM exporter scrapes to cumulative GPU- and node-seconds per run, without I/O.

The exporter (`dcgm-exporter`, port 9400) exposes one `DCGM_FI_DEV_GPU_UTIL` sample per GPU in
the Prometheus text format, labelled with the GPU (`UUID`, `gpu`, `Hostname`) and, when the GPU
is allocated to a container, the `namespace`, `pod` and `container` holding it (empty or absent
otherwise; `pod_namespace`, `pod_name`, `container_name` with `--use-old-namespace`). A GPU belongs to a run when it is
allocated. Its run id is the first of these labels the sample has:

- `run_id_label` (`run_id`: put there by a relabel);
- the pod labels that name the run as budgetgate's Kubernetes webhook and Kueue controller do,
  as dcgm-exporter writes pod labels with `--kubernetes-enable-pod-labels` (`.`, `/`, `-` → `_`):
  `budgetgate_io_run_id` (the label `budgetgate.io/run-id`), `jobset_sigs_k8s_io_jobset_uid` (a
  JobSet's UID), `batch_kubernetes_io_controller_uid` or `controller_uid` (the Job's UID);
- the pod's own UID (`pod_uid`, with `--kubernetes-enable-pod-uid`): the run id the webhook gives
  a Pod that is a run of its own (a bare Pod, a ReplicaSet's or StatefulSet's replica);

else `run_id_template` filled with namespace, pod and container. The default template,
`{namespace}/{pod}`, matches no run id the webhook or the controller assign (UIDs, or the
annotation): it only fits platforms that submit runs under that name. A RayJob's or
RayCluster's pods name their run by none of these (KubeRay labels them with the cluster's name):
relabel them into `run_id`.

A page with no sample of the metric (an empty answer, the field not collected) is a ScrapeError,
as is a page that is not Prometheus text: reading it as "no GPU held" would end every run on
that node. GPUs whose sample names no pod are not charged, and counted (`Holdings.idle`): they
are idle, or the exporter does not map GPUs to pods (then every GPU of the node looks idle).
Pods for which no run id can be formed (no run-id label, no template) are named in
`Holdings.unmapped`.

What is metered is allocation, not utilization: a run holding a GPU for a second uses one
GPU-second of its budget whether it keeps the GPU busy or not (`gpu_count × runtime_hours`).
Between two scrapes a GPU held at both counts the whole interval, a GPU held at one of them
half of it (the trapezoid rule: unbiased when a run starts or ends anywhere in the interval);
an interval longer than `max_gap` (the exporter was unreachable) is not counted, since nothing
is known about it. Node-seconds follow the same rule over the hosts holding the run's GPUs.

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

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from prometheus_client.parser import text_string_to_metric_families

UTIL_METRIC = "DCGM_FI_DEV_GPU_UTIL"
DEFAULT_RUN_ID_LABEL = "run_id"
RUN_ID_POD_LABELS = ("budgetgate_io_run_id", "jobset_sigs_k8s_io_jobset_uid", "batch_kubernetes_io_controller_uid", "controller_uid", "pod_uid")
DEFAULT_RUN_ID_TEMPLATE = "{namespace}/{pod}"


class ScrapeError(ValueError):
    """An exporter page that cannot say which runs hold its node's GPUs; the exporter failed, as
    one that did not answer."""


@dataclass(frozen=True)
class Holding:
    """The GPUs (by UUID) and hosts holding them that one run had at one scrape."""

    gpus: frozenset[str]
    hosts: frozenset[str]


class Holdings(dict[str, Holding]):
    """Which run holds which GPUs at one scrape (run id → Holding); `idle`: GPUs whose sample
    names no pod; `unmapped`: pods (`namespace/pod`) holding GPUs that no run id was formed for."""

    def __init__(self, held: Mapping[str, Holding] | None = None, *, idle: int = 0, unmapped: Iterable[str] = ()) -> None:
        super().__init__(held or {})
        self.idle = idle
        self.unmapped = frozenset(unmapped)


def _label(labels: Mapping[str, str], *names: str) -> str:
    # dcgm-exporter has written some labels in two cases or names across versions (UUID/uuid,
    # Hostname/hostname, pod/pod_name with --use-old-namespace).
    return next((labels[n] for n in names if labels.get(n)), "")


def _samples(text: str, metric: str, *, page: int, pages: int) -> Iterator[Mapping[str, str]]:
    """The labels of every sample of `metric` on one page; a ScrapeError when there is none."""
    found = 0
    where = "the exporter page" if pages == 1 else f"exporter page {page} of {pages}"
    try:
        for family in text_string_to_metric_families(text):
            if family.name != metric:
                continue
            for sample in family.samples:
                found += 1
                yield sample.labels
    except ValueError as exc:
        raise ScrapeError(f"{where} is not Prometheus text ({exc})") from exc
    if not found:
        why = "it is empty" if not text.strip() else "the exporter does not collect that field"
        raise ScrapeError(f"{where} has no {metric} sample ({why}): it cannot say which runs hold its GPUs")


def holdings(
    texts: Iterable[str],
    *,
    run_id_label: str = DEFAULT_RUN_ID_LABEL,
    run_id_template: str | None = DEFAULT_RUN_ID_TEMPLATE,
    pod_run_id_labels: Iterable[str] = RUN_ID_POD_LABELS,
    metric: str = UTIL_METRIC,
) -> Holdings:
    """Which run holds which GPUs, from the exposition texts of one scrape of every exporter
    (`run_id_template` None: only GPUs whose sample has a run-id label count).

    Raises ScrapeError (a ValueError) when a page is not Prometheus text or has no sample of `metric`."""
    pages = list(texts)
    run_id_labels = (run_id_label, *pod_run_id_labels)
    gpus: dict[str, set[str]] = {}
    hosts: dict[str, set[str]] = {}
    idle, unmapped = 0, set()
    for page, text in enumerate(pages, start=1):
        for labels in _samples(text, metric, page=page, pages=len(pages)):
            run_id = _label(labels, *run_id_labels)
            if not run_id:
                pod, namespace = _label(labels, "pod", "pod_name"), _label(labels, "namespace", "pod_namespace")
                if not pod:
                    idle += 1  # nobody is charged for it
                    continue
                if run_id_template is None:
                    unmapped.add(f"{namespace}/{pod}")
                    continue
                run_id = run_id_template.format(namespace=namespace, pod=pod, container=_label(labels, "container", "container_name"))
            host = _label(labels, "Hostname", "hostname")
            gpu = _label(labels, "UUID", "uuid") or f"{host}/{labels.get('gpu', '')}"
            gpus.setdefault(run_id, set()).add(gpu)
            hosts.setdefault(run_id, set()).add(host)
    held = {run_id: Holding(frozenset(found), frozenset(hosts[run_id])) for run_id, found in gpus.items()}
    return Holdings(held, idle=idle, unmapped=unmapped)


@dataclass(frozen=True)
class Usage:
    """A run's GPU- and node-seconds since the meter first saw it (cumulative)."""

    run_id: str
    observed_at: datetime
    gpu_seconds: float
    node_seconds: float


EVERY_EXPORTER = "*"  # the page of a state saved before pages were kept per exporter: all of them at once
_NONE_HELD = Holding(frozenset(), frozenset())


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
            self._count((at - since).total_seconds(), before, after)
        self.pages.update({exporter: Page(at, dict(held)) for exporter, held in answered.items()})
        # A page older than max_gap ends an interval that can no longer be counted: its holdings are gone.
        self.pages = {exporter: page for exporter, page in self.pages.items() if at - page.at <= self.max_gap}
        held_before, self.last_at, self.last = self.last, at, _union(page.held for page in self.pages.values())
        return [Usage(run_id, at, *self.totals.setdefault(run_id, (0.0, 0.0))) for run_id in sorted(set(held_before) | set(self.last))]

    def _intervals(self, answered: Mapping[str, Mapping[str, Holding]], *, every: bool) -> list[tuple[datetime, dict[str, Holding], dict[str, Holding]]]:
        """The intervals this scrape ends, one per time its answering exporters last answered:
        (that time, what their pages held then, what they hold now). An exporter never read
        before ends none."""
        legacy = self.pages.get(EVERY_EXPORTER)
        if legacy is not None and every and len(self.pages) == 1:
            del self.pages[EVERY_EXPORTER]
            return [(legacy.at, dict(legacy.held), _union(answered.values()))]
        since: dict[datetime, list[str]] = {}
        for exporter in answered:
            if exporter in self.pages:
                since.setdefault(self.pages[exporter].at, []).append(exporter)
        return [(then, _union(self.pages[e].held for e in exporters), _union(answered[e] for e in exporters)) for then, exporters in since.items()]

    def _count(self, seconds: float, before: Mapping[str, Holding], after: Mapping[str, Holding]) -> None:
        if seconds > self.max_gap.total_seconds():
            return  # nothing is known about it
        for run_id in set(before) | set(after):
            held_before, held_after = before.get(run_id, _NONE_HELD), after.get(run_id, _NONE_HELD)
            gpu, node = self.totals.get(run_id, (0.0, 0.0))
            gpu += seconds * (len(held_before.gpus) + len(held_after.gpus)) / 2
            node += seconds * (len(held_before.hosts) + len(held_after.hosts)) / 2
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


def _union(pages: Iterable[Mapping[str, Holding]]) -> dict[str, Holding]:
    """What each run holds on any of `pages`."""
    union: dict[str, Holding] = {}
    for page in pages:
        for run_id, held in page.items():
            known = union.get(run_id, _NONE_HELD)
            union[run_id] = Holding(known.gpus | held.gpus, known.hosts | held.hosts)
    return union


def _held_state(held: Mapping[str, Holding]) -> dict[str, object]:
    return {run: {"gpus": sorted(h.gpus), "hosts": sorted(h.hosts)} for run, h in held.items()}


def _held(state: object) -> dict[str, Holding]:
    return {run: Holding(frozenset(h["gpus"]), frozenset(h["hosts"])) for run, h in state.items()}  # type: ignore[attr-defined]


def sample_id(exporter: str, at: datetime) -> str:
    """The id of the sample a meter sends for a run at one scrape: the same on a resend."""
    return f"{exporter}@{int(at.timestamp() * 1000)}"
