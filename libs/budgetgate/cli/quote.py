"""`budgetgate quote`: what admission would decide on a submission now, asked of the running
admission service (POST /v1/quotes); nothing is reserved or recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from budgetgate.cli import backend
from budgetgate.runtime.settings import CommonSettings, dev_token, find_dev_state


class ClientSettings(CommonSettings):
    admission_url: str = "http://127.0.0.1:8080"


def label_pairs(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    labels = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is not KEY=VALUE")
        labels[key] = val
    return labels


@click.command()
@click.option(
    "--file",
    "body_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A submission body as JSON (what POST /v1/admissions takes); the options below override its fields.",
)
@click.option("--run-id", default=None, help="The run id (default: quote/preview).")
@click.option("--namespace", "-n", default=None, help="The submission's namespace.")
@click.option("--label", "-l", "labels", multiple=True, callback=label_pairs, help="A label, KEY=VALUE; repeatable.")
@click.option("--gpus", type=int, default=None)
@click.option("--nodes", type=int, default=None)
@click.option("--flavor", default=None)
@click.option("--region", default=None)
@click.option("--hours", "runtime_hours", type=float, default=None, help="Projected runtime in hours.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def quote(
    body_file: Path | None,
    run_id: str | None,
    namespace: str | None,
    labels: dict[str, str],
    gpus: int | None,
    nodes: int | None,
    flavor: str | None,
    region: str | None,
    runtime_hours: float | None,
    as_json: bool,
) -> None:
    """What admission would decide on a submission now (decision, cost, next eligible time)."""
    body = request_body(
        body_file, run_id=run_id, namespace=namespace, labels=labels, gpus=gpus, nodes=nodes, flavor=flavor, region=region, runtime_hours=runtime_hours
    )
    body.setdefault("run_id", "quote/preview")
    answer = post_quote(body)
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    print_quote(answer)


def request_body(
    body_file: Path | None,
    *,
    run_id: str | None,
    namespace: str | None,
    labels: dict[str, str],
    gpus: int | None,
    nodes: int | None,
    flavor: str | None,
    region: str | None,
    runtime_hours: float | None,
    attempt: int | None = None,
) -> dict[str, Any]:
    """A submission's body (POST /v1/admissions) from a --file and the options over it; a usage
    error naming what is missing or what the file is not."""
    body: dict[str, Any] = {}
    if body_file is not None:
        try:
            body = json.loads(body_file.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(f"cannot read {body_file}: {exc}", param_hint="--file") from None
        except ValueError as exc:
            raise click.BadParameter(f"{body_file} is not JSON: {exc}", param_hint="--file") from None
        if not isinstance(body, dict):
            raise click.BadParameter(f"{body_file} holds a JSON {type(body).__name__}, not a submission object", param_hint="--file")
    resources = body.get("resources") or {}
    if not isinstance(resources, dict):
        raise click.BadParameter(f"{body_file}: resources is not an object", param_hint="--file")
    resources = dict(resources)
    overrides = {"gpus": gpus, "nodes": nodes, "flavor": flavor, "region": region}
    resources.update({k: v for k, v in overrides.items() if v is not None})
    resources.setdefault("nodes", 1)
    body["resources"] = resources
    for key, value in (("run_id", run_id), ("namespace", namespace), ("projected_runtime_hours", runtime_hours), ("attempt", attempt)):
        if value is not None:
            body[key] = value
    if labels:
        body["labels"] = {**(body.get("labels") or {}), **labels}
    missing = [
        name
        for name, present in (("--namespace", "namespace" in body), ("--gpus", "gpus" in resources), ("--hours", "projected_runtime_hours" in body))
        if not present
    ]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (or a --file that has them)")
    return body


def post_quote(body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    if find_dev_state() is None and not os.environ.get("BUDGETGATE_ADMISSION_URL"):
        raise click.ClickException(f"no local stack found from {Path.cwd()}; start one with `budgetgate dev up`, or set BUDGETGATE_ADMISSION_URL")
    url = ClientSettings().admission_url
    backend.announce("admission", url)
    try:
        token = dev_token("submitter")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = httpx.post(f"{url.rstrip('/')}/v1/quotes", json=body, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot reach admission at {url}: {exc}; is the stack running (`budgetgate dev status`)?") from None
    if response.status_code != 200:
        raise click.ClickException(f"admission answered {response.status_code}: {response.text}")
    return response.json()


def print_quote(answer: dict[str, Any]) -> None:
    cost = f", {answer['showback_cost']:.2f} {answer['currency']}" if answer.get("showback_cost") is not None else ""
    click.echo(f"{answer['decision']} (a quote: nothing reserved) — {answer['projected_gpu_hours']:g} GPU-hours{cost}")
    click.echo(answer["reason"])
    if answer.get("next_eligible_time"):
        click.echo(f"next eligible time: {answer['next_eligible_time']}")
    if answer.get("priority_penalty"):
        click.echo(f"priority penalty: {answer['priority_penalty']:.4f}")
    if answer.get("fair_share"):
        fs = answer["fair_share"]
        decayed = f", decayed {fs['decayed_share']:.3f} (half-life {fs['half_life_hours']:g} h)" if "decayed_share" in fs else ""
        click.echo(
            f"fair share: {fs['share']:.3f} -> {fs['share_after']:.3f}{decayed} of target {fs['target']:.3f} (deficit {fs['deficit']:.3f})"
            + (", preemptible" if answer.get("preemptible") else "")
        )
    for e in answer["evaluations"]:
        remaining = "n/a" if e["remaining"] is None else f"{e['remaining']:g}"
        click.echo(
            f"  {e['decision']:<5} {e['policy_id']} ({e['enforcement']}): needs {e['projected']:g} of {remaining} remaining, limit {e['limit']:g} {e['unit']}"
        )
