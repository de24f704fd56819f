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
    """An exporter page that cannot say which runs hold its node's GPUs; skip the scrape, as
    for an exporter that did not answer."""


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
    try:
        for family in text_string_to_metric_families(text):
            if family.name != metric:
                continue
            for sample in family.samples:
                found += 1
                yield sample.labels
    except ValueError as exc:
        raise ScrapeError(f"exporter page {page} of {pages} is not Prometheus text ({exc})") from exc
    if not found:
        why = "it is empty" if not text.strip() else "the exporter does not collect that field"
        raise ScrapeError(f"exporter page {page} of {pages} has no {metric} sample ({why}): it cannot say which runs hold its GPUs")


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


@dataclass
class Meter:
    """Folds successive scrapes into each run's cumulative seconds; its state (`totals`, the
    last scrape) can be saved and restored so a restarted meter does not count from zero."""

    max_gap: timedelta = timedelta(minutes=5)
    totals: dict[str, tuple[float, float]] = field(default_factory=dict)
    last_at: datetime | None = None
    last: dict[str, Holding] = field(default_factory=dict)

    def observe(self, at: datetime, now_holding: Mapping[str, Holding]) -> list[Usage]:
        """Count the interval since the last scrape; the cumulative usage of every run held at
        either end of it (a run that ended is reported once more). Totals are kept for runs no
        longer held, so a run that holds GPUs again (re-admitted) goes on from its total."""
        if self.last_at is not None and at <= self.last_at:
            raise ValueError(f"scrape at {at.isoformat()} is not after the previous one ({self.last_at.isoformat()})")
        seconds = (at - self.last_at).total_seconds() if self.last_at is not None else 0.0
        counted = seconds if seconds <= self.max_gap.total_seconds() else 0.0
        empty = Holding(frozenset(), frozenset())
        usages = []
        for run_id in sorted(set(self.last) | set(now_holding)):
            before, after = self.last.get(run_id, empty), now_holding.get(run_id, empty)
            gpu, node = self.totals.get(run_id, (0.0, 0.0))
            gpu += counted * (len(before.gpus) + len(after.gpus)) / 2
            node += counted * (len(before.hosts) + len(after.hosts)) / 2
            self.totals[run_id] = (gpu, node)
            usages.append(Usage(run_id, at, gpu, node))
        self.last_at, self.last = at, dict(now_holding)
        return usages

    def state(self) -> dict[str, object]:
        """What to save between runs of the meter (JSON-ready)."""
        return {
            "last_at": self.last_at.isoformat() if self.last_at else None,
            "totals": {run: list(t) for run, t in self.totals.items()},
            "last": {run: {"gpus": sorted(h.gpus), "hosts": sorted(h.hosts)} for run, h in self.last.items()},
        }

    @classmethod
    def restored(cls, state: Mapping[str, object], *, max_gap: timedelta) -> Meter:
        """A meter continuing from `state()`."""
        last_at = state.get("last_at")
        totals = state.get("totals") or {}
        last = state.get("last") or {}
        return cls(
            max_gap=max_gap,
            totals={run: (float(t[0]), float(t[1])) for run, t in totals.items()},  # type: ignore[union-attr]
            last_at=datetime.fromisoformat(last_at) if isinstance(last_at, str) else None,
            last={run: Holding(frozenset(h["gpus"]), frozenset(h["hosts"])) for run, h in last.items()},  # type: ignore[union-attr]
        )


def sample_id(exporter: str, at: datetime) -> str:
    """The id of the sample a meter sends for a run at one scrape: the same on a resend."""
    return f"{exporter}@{int(at.timestamp() * 1000)}"
