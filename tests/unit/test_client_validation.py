"""A request the client refuses before sending is an InvalidRequest (a BudgetgateError, so one
`except BudgetgateError` catches every refusal) naming each offending field, in the sync and the
async client alike, and nothing reaches the network."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from budgetgate.client import AsyncClient, BudgetgateError, Client, InvalidRequest, lifecycle_event
from tests.support.admission import submission


def nothing_sent(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"the client sent {request.method} {request.url} although the request was invalid")


def bad_gpus() -> dict[str, Any]:
    return submission(resources={"gpus": -1, "nodes": 1})


CASES: list[tuple[str, Callable[[Any], Any], list[str]]] = [
    ("submit", lambda c: c.submit(bad_gpus()), ["resources.gpus"]),
    (
        "two fields",
        lambda c: c.submit(submission(resources={"gpus": -1, "nodes": 0}, projected_runtime_hours=0.0)),
        ["resources.gpus", "resources.nodes", "projected_runtime_hours"],
    ),  # fmt: skip
    ("missing", lambda c: c.submit({"run_id": "r", "resources": {"gpus": 1}, "projected_runtime_hours": 1.0}), ["namespace"]),
    ("unknown field", lambda c: c.submit({**submission(), "gpu": 1}), ["gpu"]),
    ("not a mapping", lambda c: c.submit(["run"]), [""]),
    ("allocate", lambda c: c.allocate("snowflake:wh-1", {"token": "run:x"}), ["token"]),
    ("update_tenant", lambda c: c.update_tenant("vision", {"no_such_setting": 1}), ["no_such_setting"]),
    ("resolve_settlement", lambda c: c.resolve_settlement("r", action="release", reason=""), ["reason"]),
]


def check(error: InvalidRequest, fields: list[str]) -> None:
    assert isinstance(error, BudgetgateError) and isinstance(error, ValueError)
    assert sorted(error.fields) == sorted(fields) and error.status == 422 and error.sent is False
    assert all(e["msg"] for e in error.errors)
    assert error.detail.startswith("invalid ") and all((f or "body") in error.detail for f in fields)


@pytest.mark.parametrize(("name", "call", "fields"), CASES, ids=[c[0] for c in CASES])
def test_the_sync_client_raises_invalid_request(name: str, call: Callable[[Client], Any], fields: list[str]) -> None:
    with Client("http://budgetgate.invalid", reconciler_url="http://budgetgate.invalid", transport=httpx.MockTransport(nothing_sent)) as client:
        with pytest.raises(BudgetgateError) as refused:
            call(client)
    check(refused.value, fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "call", "fields"), CASES, ids=[c[0] for c in CASES])
async def test_the_async_client_raises_invalid_request(name: str, call: Callable[[AsyncClient], Any], fields: list[str]) -> None:
    transport = httpx.MockTransport(nothing_sent)
    async with AsyncClient("http://budgetgate.invalid", reconciler_url="http://budgetgate.invalid", transport=transport) as client:
        with pytest.raises(BudgetgateError) as refused:
            await call(client)
    check(refused.value, fields)  # type: ignore[arg-type]


def test_the_message_names_the_field_and_the_rule() -> None:
    with Client("http://budgetgate.invalid", transport=httpx.MockTransport(nothing_sent)) as client:
        with pytest.raises(InvalidRequest) as refused:
            client.submit(bad_gpus())
    assert str(refused.value) == "422 Unprocessable Content (found before sending): invalid resources.gpus: Input should be greater than or equal to 0"


def test_a_lifecycle_event_of_an_unknown_kind_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequest) as refused:
        lifecycle_event("r", "FINISHED")
    assert refused.value.fields == ["type"] and "STARTED" in refused.value.detail
