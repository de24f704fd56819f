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


def _root() -> Path:
    """The stack's folder: BUDGETGATE_HOME, else the nearest folder at or above this one with a
    `.budgetgate/dev.json`, else this folder (where `up` creates one)."""
    import os

    from budgetgate.devstack import stack

    home = os.environ.get("BUDGETGATE_HOME")
    if home:
        return Path(home).expanduser()
    return stack.find_root() or Path.cwd()


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
@click.option("--redis-cluster", is_flag=True, help="A Redis Cluster of three masters with a replica each instead of one redis-server.")
def up(detach: bool, timeout: float, no_services: bool, redis_cluster: bool) -> None:
    """Start the stack of this folder (in the foreground unless --detach); exit 2 when a part is not running."""
    from budgetgate.devstack import stack

    root = _root()
    _interrupt_on_sigterm()
    try:
        result = stack.up(root, timeout=timeout, services=not no_services, redis_cluster=redis_cluster, echo=_echo)
    except stack.STACK_ERRORS as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        sys.exit(130)
    info = stack.status(result.state.root) or {}
    dead = [s["name"] for s in info.get("services", []) if not s["alive"]]
    if result.already_up:
        click.echo(f"a stack is already up in {result.state.root}; see `budgetgate dev status`")
    _print_services(info)
    if dead:
        click.echo(
            f"not running: {', '.join(dead)}; see the logs in {result.state.root / '.budgetgate' / 'logs'}, then `budgetgate dev down` and `up` to restart it",
            err=True,
        )
        if not result.already_up and not detach:
            stack.down(root, echo=_echo)
        sys.exit(2)
    if result.already_up:
        return
    if detach:
        click.echo("stack is up; stop it with `budgetgate dev down`")
        return
    click.echo("stack is up; Ctrl-C stops it")
    stack.run_foreground(root, echo=_echo)


@dev.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(as_json: bool) -> None:
    """Every service of the stack and its URL. Exit 1 when none is up, 2 when part of it is down."""
    from budgetgate.devstack import stack

    root = _root()
    try:
        info = stack.status(root)
    except stack.STACK_ERRORS as exc:
        raise click.ClickException(str(exc)) from exc
    if info is None:
        if as_json:
            click.echo(json.dumps({"up": False}))
        else:
            click.echo(f"no stack is up in {root} or a folder above it (BUDGETGATE_HOME names another); start one with `budgetgate dev up`", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        click.echo(f"stack in {info['root']}")
        _print_services(info)
        click.echo(f"{'redis_prefix':<18} {info.get('redis_prefix') or '-'}")
        click.echo(f"{'topic_prefix':<18} {info.get('topic_prefix') or '-'}")
        for proc in info["processes"]:
            click.echo(f"  {proc['name']:<18} pid {proc['pid']:<8} {'alive' if proc['alive'] else 'DEAD'}  {proc['log']}")
    alive = [s["alive"] for s in info["services"]]
    if alive and not any(alive):
        sys.exit(1)
    if not info["complete"]:
        click.echo("the stack is still starting, or the `dev up` that started it died midway", err=True)
        sys.exit(2)
    if not all(alive):
        sys.exit(2)


@dev.command()
def down() -> None:
    """Stop what `dev up` started for this folder's stack (and nothing else)."""
    from budgetgate.devstack import stack

    root = _root()
    try:
        stopped = stack.down(root, echo=_echo)
    except stack.STACK_ERRORS as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"stack in {root} stopped" if stopped else f"no stack is up in {root}")


def _print_services(info: dict[str, Any]) -> None:
    """One line per service: name, URL, running or not."""
    for service in info.get("services", []):
        where = "" if service["started_here"] else " (not started by this stack)"
        click.echo(f"{service['name']:<18} {service['url'] or '-':<60} {'up' if service['alive'] else 'DOWN'}{where}")
