"""Every service has the same files for the same roles (docs/architecture.md, "One service
skeleton"): `__main__.py` serves its `create_app`, `settings.py`, `service.py` (its Service, run by
the shared runner), `app.py` (only `create_app`), `queries.sql`; `routes.py` (or a `routes/`
package), `consumers.py` (its Subscription) and `store.py` where it has them; and no file of
one of those roles under another name."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from budgetgate.edge.runner import Service
from budgetgate.messaging.subscriber import Subscription

SERVICES = Path(__file__).resolve().parents[2] / "services"
NAMES = ["admission", "metering_ingest", "reconciler", "evidence_emitter"]
EVERY_SERVICE = {"__init__.py", "__main__.py", "settings.py", "service.py", "app.py", "queries.sql"}
# The roles a service may lack (and then has no file for): its own HTTP routes, Kafka routes, SQL store.
OPTIONAL = {"admission": {"routes"}, "metering_ingest": {"routes", "consumers.py", "store.py"}, "reconciler": {"routes.py", "consumers.py"}}
OPTIONAL["evidence_emitter"] = {"consumers.py"}
# Names the skeleton's roles went by before, or would go by elsewhere: a service object, an app,
# an entry point or routes under another name.
OTHER_NAMES = {"runtime.py", "worker.py", "server.py", "main.py", "api.py", "application.py", "lifespan.py", "runner.py"}


def test_the_services_are_the_four_known() -> None:
    assert sorted(p.name for p in SERVICES.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_service_has_the_skeleton_files_and_no_other_name_for_their_roles(name: str) -> None:
    folder = SERVICES / name
    files = {p.name for p in folder.iterdir() if not p.name.startswith((".", "__pycache__"))}
    assert EVERY_SERVICE <= files, f"{name} lacks {sorted(EVERY_SERVICE - files)}"
    assert not files & OTHER_NAMES, f"{name} has {sorted(files & OTHER_NAMES)}: the skeleton names them service.py, app.py or routes"
    assert not {f for f in files if f.endswith(("_routes.py", "_app.py", "_service.py"))}, name
    assert not ({"routes.py", "routes"} <= files), f"{name}: routes.py or a routes/ package, not both"
    optional = {"routes" if f == "routes.py" else f for f in files & {"routes.py", "routes", "consumers.py", "store.py"}}
    expected = {"routes" if f == "routes.py" else f for f in OPTIONAL[name]}
    assert optional == expected, f"{name}: {sorted(optional)}, expected {sorted(expected)}"
    if (folder / "routes").is_dir():
        inner = {p.name for p in (folder / "routes").iterdir() if p.suffix == ".py"}
        assert "__init__.py" in inner and len(inner) > 2, f"{name}/routes is a package of route modules"


@pytest.mark.parametrize("name", NAMES)
def test_service_py_holds_a_service_of_the_runner(name: str) -> None:
    module = importlib.import_module(f"budgetgate.services.{name}.service")
    mine = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__ and issubclass(c, Service)]
    assert len(mine) == 1, f"{name}/service.py: {mine}"
    [service] = mine
    assert hasattr(service, "build") or hasattr(service, "create"), f"{service.__name__} is made by build or create from its settings"
    for method in ("checks", "close"):
        assert getattr(service, method) is not getattr(Service, method), f"{service.__name__} says its own {method}()"


@pytest.mark.parametrize("name", NAMES)
def test_app_py_defines_only_create_app_through_the_runner(name: str) -> None:
    source = (SERVICES / name / "app.py").read_text()
    tree = ast.parse(source)
    public = [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not n.name.startswith("_")]
    assert public == ["create_app"], f"{name}/app.py: {public}"
    assert "service_app(" in source and "operational_routes(" in source, f"{name}/app.py builds its app with the shared runner"
    main = (SERVICES / name / "__main__.py").read_text()
    assert f"from budgetgate.services.{name}.app import create_app" in main and "serve(" in main, f"{name}/__main__.py serves create_app"


@pytest.mark.parametrize("name", [n for n in NAMES if "consumers.py" in OPTIONAL[n]])
def test_consumers_py_declares_one_subscription(name: str) -> None:
    module = importlib.import_module(f"budgetgate.services.{name}.consumers")
    settings = next(
        c
        for _, c in inspect.getmembers(importlib.import_module(f"budgetgate.services.{name}.settings"), inspect.isclass)
        if c.__name__.endswith("Settings") and c.__module__.endswith(f"{name}.settings")
    )
    from budgetgate.contracts.topics import Topics

    declared = module.subscription(settings(), Topics("p-"))
    assert isinstance(declared, Subscription)
    subscribed = {getattr(topic, "name", topic) for subscriber in declared.router(lambda: None).subscribers for topic in subscriber.topics}  # type: ignore[attr-defined]
    assert subscribed == set(declared.routes) and subscribed, f"{name}: subscribes exactly the topics it routes"
    assert not hasattr(module, "router") and not hasattr(module, "routes"), f"{name}: the subscription is the one declaration"
