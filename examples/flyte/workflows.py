"""A training workflow whose GPU use budgetgate can project: each GPU task says its GPUs
(`Resources(gpu=…)`), its accelerator and its timeout."""

from __future__ import annotations

from datetime import timedelta

from flytekit import Resources, task, workflow
from flytekit.extras.accelerators import H100


@task(requests=Resources(cpu="32", mem="256Gi", gpu="8"), accelerator=H100, timeout=timedelta(hours=6))
def train(epochs: int) -> float:
    return 0.9 + epochs * 0.001


@task(requests=Resources(cpu="4", mem="32Gi", gpu="1"), accelerator=H100, timeout=timedelta(minutes=30))
def evaluate(score: float) -> float:
    return score


@task(requests=Resources(cpu="1", mem="1Gi"), timeout=timedelta(minutes=10))
def report(score: float) -> str:
    return f"accuracy {score:.3f}"


@workflow
def training(epochs: int = 10) -> str:
    """8 H100s for up to 6 h, then one for up to 30 min: 48.5 GPU-hours at most."""
    return report(score=evaluate(score=train(epochs=epochs)))
