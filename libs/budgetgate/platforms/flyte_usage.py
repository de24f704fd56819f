"""What a Flyte execution is, and what it projects, in the terms both Flyte paths share, without
I/O: the preflight (budgetgate.adapters.flyte, reading flytekit's models) and the admission
webhook on flytepropeller's FlyteWorkflow objects (flyte_workflows, reading their JSON) name a run
and count its GPU-hours by these same rules, so that their decisions are about one run.

- `flyte_run_id`: the run id of an execution, `flyte/<project>/<domain>/<execution name>`.
- `TaskUse`, `Projection`: one task node's projected use, and the execution's (the sum of GPU-
  hours, submitted as the largest node's GPUs for as long as the sum takes them).
- `gpu_count`, `POD_GPU`: a GPU count as Flyte writes one, and the resource names of GPUs in a pod
  template; `attempts`: flytepropeller's retries rule; `costliest`: a branch's case; `mapped`: a
  map's element spread over its elements.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

# flytekit's `gpu` (flytepropeller names it), nvidia.com/gpu, amd.com/gpu
POD_GPU = re.compile(r"^([a-z0-9.-]+/)?gpu$")


class Unprojectable(ValueError):
    """An entity whose GPU-hours cannot be projected; the message says what to add."""


def flyte_run_id(project: str, domain: str, name: str) -> str:
    """The run id of the execution `name` in `project` and `domain`: what the preflight submits
    and what the webhook reads off a FlyteWorkflow's labels."""
    for what, value in (("project", project), ("domain", domain), ("execution name", name)):
        if not value or "/" in value:
            raise ValueError(f"a Flyte {what} is a non-empty name without '/', got {value!r}")
    return f"flyte/{project}/{domain}/{name}"


@dataclass(frozen=True)
class TaskUse:
    """One task node's projected use: `gpus` at once for `hours`, on `flavor`. `hours` covers all
    its `attempts`; a map's node holds its `instances` (elements) at `gpus` for as long as they
    take, at most its concurrency at once."""

    name: str
    gpus: int
    hours: float
    flavor: str | None
    node: str = ""
    attempts: int = 1
    instances: int = 1

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.hours


@dataclass(frozen=True)
class Projection:
    """What an execution is projected to use, task node by task node."""

    tasks: tuple[TaskUse, ...]

    @property
    def gpu_hours(self) -> float:
        return sum(t.gpu_hours for t in self.tasks)

    @property
    def gpus(self) -> int:
        return max((t.gpus for t in self.tasks), default=0)

    @property
    def runtime_hours(self) -> float:
        """Hours the largest task's GPUs would take for all the GPU-hours (the longest task's
        hours for CPU-only work)."""
        if self.gpus:
            return self.gpu_hours / self.gpus
        return max((t.hours for t in self.tasks), default=0.0)

    @property
    def flavor(self) -> str | None:
        """The flavor of most of the GPU-hours."""
        by_flavor: dict[str, float] = {}
        for t in self.tasks:
            if t.flavor and t.gpus:
                by_flavor[t.flavor] = by_flavor.get(t.flavor, 0.0) + t.gpu_hours
        return max(by_flavor, key=by_flavor.__getitem__) if by_flavor else None


def flavor_of(device: str) -> str:
    """The rate card's flavor of a Flyte accelerator device name."""
    name = device.lower().removeprefix("nvidia-").removeprefix("tesla-")
    return re.sub(r"[^a-z0-9._-]", "-", name)


def gpu_count(value: Any, what: str) -> int | None:
    """A GPU count as Flyte writes one ("2", 2, a Kubernetes quantity "2"); None when empty."""
    if value in (None, ""):
        return None
    try:
        count = float(str(value))
    except ValueError:
        raise Unprojectable(f"{what}: gpu={value!r} is not a number of GPUs") from None
    if count < 0 or count != int(count):
        raise Unprojectable(f"{what}: gpu={value!r} is not a whole number of GPUs")
    return int(count)


def attempts(node_retries: int, task_retries: int, *, count_retries: bool) -> int:
    """A task node's attempts: retries + 1, the node's retries when not 0, else the task's
    (flytepropeller's rule); one with `count_retries=False`."""
    if not count_retries:
        return 1
    return (node_retries or task_retries) + 1


def costliest(options: Sequence[list[TaskUse]]) -> list[TaskUse]:
    """A branch: the case with the most GPU-hours (the first of equals), since which one runs is
    decided at run time."""
    return max(options, key=lambda uses: sum(u.gpu_hours for u in uses), default=[])


def mapped(element: list[TaskUse], elements: int, parallelism: int | None) -> list[TaskUse]:
    """A map's node: its element × `elements`, at most `parallelism` at once (none or 0: all)."""
    if not elements:
        return []
    at_once = min(elements, parallelism) if parallelism else elements
    return [replace(u, gpus=u.gpus * at_once, hours=u.hours * elements / at_once, instances=u.instances * elements) for u in element]
