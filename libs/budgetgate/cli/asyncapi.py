"""`budgetgate asyncapi`: the AsyncAPI document of every Kafka topic (budgetgate.services.asyncapi)."""

from __future__ import annotations

import importlib
import json

import click
import yaml

# The document includes the Kafka-consuming services' real routers, so it is built beside the
# services; the library imports no service, and names this module only by its path, as a
# service is named to launch it.
BUILDER = "budgetgate.services.asyncapi"


@click.command()
@click.option("--prefix", default="", help="Topic name prefix (BUDGETGATE_TOPIC_PREFIX of the deployment).")
@click.option("--format", "fmt", type=click.Choice(["json", "yaml"]), default="json", show_default=True)
def asyncapi(prefix: str, fmt: str) -> None:
    """Print the AsyncAPI document of every Kafka topic."""
    data = importlib.import_module(BUILDER).document(prefix=prefix)
    click.echo(json.dumps(data, indent=2) if fmt == "json" else yaml.safe_dump(data, sort_keys=False))
