"""A command's call of a budgetgate service's API with the project's client: which service it
reached said on stderr, the operator's token sent (BUDGETGATE_TOKEN, else the local stack's token
of the role asked for), and every way it can fail a one-line error: an error answer (each
offending field listed), no URL known, or no answer at all. A request the client refuses before
sending it (a value no request may have) is a usage error (exit 2); the others exit with
`failure`'s code (1, unless the command says otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import click

if TYPE_CHECKING:
    from budgetgate.client import Client

T = TypeVar("T")


class Failed(click.ClickException):
    """A command's call that failed: exit 1."""


def call(
    work: Callable[[Client], T],
    *,
    service: str,
    url: Callable[[Client], str],
    role: str = "operator",
    failure: type[click.ClickException] = Failed,
) -> T:
    """`work(client)`, announcing `service` at `url(client)`."""
    import httpx

    from budgetgate.client import BudgetgateError, Client, InvalidRequest, NoEndpoint
    from budgetgate.runtime.settings import dev_token

    where = service
    try:
        with Client(token=dev_token(role)) as client:
            where = f"{service} at {url(client)}"
            click.echo(f"budgetgate: {where}", err=True)
            return work(client)
    except InvalidRequest as exc:
        if not exc.sent:
            raise click.UsageError(exc.detail) from None
        for error in exc.errors:
            click.echo(f"error: {error.get('field') or 'body'}: {error.get('msg')}", err=True)
        raise failure(exc.detail) from None
    except (BudgetgateError, NoEndpoint) as exc:
        raise failure(str(exc)) from None
    except httpx.HTTPError as exc:  # no answer, even after the client's resends
        raise failure(f"cannot reach {where}: {' '.join(str(exc).split()) or type(exc).__name__}") from None
