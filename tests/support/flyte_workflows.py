"""Real flytekit workflows for the Flyte preflight's tests, compiled locally by flytekit when
this module is imported; the example of examples/flyte/ loaded as well."""

from __future__ import annotations

import importlib.util
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType

from flytekit import Resources, task, workflow
from flytekit.extras.accelerators import A100

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flyte" / "workflows.py"


def example() -> ModuleType:
    """examples/flyte/workflows.py, imported as flytekit would import it."""
    name = "budgetgate_example_flyte_workflows"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec and spec.loader, f"{EXAMPLE} is missing"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@task(limits=Resources(gpu="2"), accelerator=A100, timeout=timedelta(hours=3))
def prepare(n: int) -> int:
    return n


@task(requests=Resources(gpu="4"), accelerator=A100, timeout=timedelta(hours=1))
def finetune(n: int) -> int:
    return n


@task(requests=Resources(gpu="1"))
def untimed(n: int) -> int:
    return n


@workflow
def inner(n: int) -> int:
    return finetune(n=n)


@workflow
def nested(n: int = 1) -> int:
    """2 A100s × 3 h, then a sub-workflow with 4 A100s × 1 h: 10 GPU-hours."""
    return inner(n=prepare(n=n))


@workflow
def without_timeout(n: int = 1) -> int:
    return untimed(n=n)
