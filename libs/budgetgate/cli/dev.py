"""`budgetgate dev …`: the local stack (see budgetgate.devstack)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import click


@click.group()
def dev() -> None:
    """Run Postgres, Redis, Kafka and the services on this machine."""


def _echo(message: str) -> None:
    click.echo(message, err=True)


def _interrupt_on_sigterm() -> None:
    # SIGTERM (a supervisor, `kill`) then unwinds like Ctrl-C: whatever was started gets stopped.
    def handler(signum: int, frame: Any) -> NoReturn:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


@dev.command()
@click.option("--detach", is_flag=True, help="Return once everything is ready and leave it running.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds each part may take to become ready.")
@click.option("--no-services", is_flag=True, help="Only Postgres, Redis and Kafka (run services yourself).")
def up(detach: bool, timeout: float, no_services: bool) -> None:
    """Start the stack of this directory (in the foreground unless --detach)."""
    from budgetgate.devstack import stack

    root = Path.cwd()
    _interrupt_on_sigterm()
    try:
        result = stack.up(root, timeout=timeout, services=not no_services, echo=_echo)
    except stack.STACK_ERRORS as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        sys.exit(130)
    if result.already_up:
        dead = [name for name, alive in result.state.alive().items() if not alive]
        click.echo(f"a stack is already up in {result.state.root}; see `budgetgate dev status`")
        if dead:
            click.echo(f"not running: {', '.join(dead)}; `budgetgate dev down` then `up` to restart it")
        return
    _print_settings(result.state.settings)
    if detach:
        click.echo("stack is up; stop it with `budgetgate dev down`")
        return
    click.echo("stack is up; Ctrl-C stops it")
    stack.run_foreground(root, echo=_echo)


@dev.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(as_json: bool) -> None:
    """Show the stack of this directory. Exit 1 when none is up, 2 when part of it is down."""
    from budgetgate.devstack import stack

    try:
        info = stack.status(Path.cwd())
    except stack.STACK_ERRORS as exc:
        raise click.ClickException(str(exc)) from exc
    if info is None:
        if as_json:
            click.echo(json.dumps({"up": False}))
        else:
            click.echo(f"no stack is up in {Path.cwd()}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        _print_settings(info)
        for proc in info["processes"]:
            click.echo(f"  {proc['name']:<18} pid {proc['pid']:<8} {'alive' if proc['alive'] else 'DEAD'}  {proc['log']}")
    alive = [p["alive"] for p in info["processes"]]
    if alive and not any(alive):
        sys.exit(1)
    if not info["complete"]:
        click.echo("the stack is still starting, or the `dev up` that started it died midway", err=True)
        sys.exit(2)
    if not all(alive):
        sys.exit(2)


@dev.command()
def down() -> None:
    """Stop what `dev up` started in this directory (and nothing else)."""
    from budgetgate.devstack import stack

    try:
        stopped = stack.down(Path.cwd(), echo=_echo)
    except stack.STACK_ERRORS as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo("stack stopped" if stopped else f"no stack is up in {Path.cwd()}")


def _print_settings(settings: dict[str, Any]) -> None:
    for key in ("admission_url", "postgres_dsn", "redis_url", "redis_prefix", "kafka_bootstrap", "topic_prefix"):
        value = settings.get(key)
        click.echo(f"{key:<16} {value if value not in (None, '') else '-'}")
