"""`budgetgate meter dcgm`'s options without running it, and how an exporter pod becomes a URL:
the state kept by default, what it refuses, the MIG table an operator adds to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from budgetgate.adapters.dcgm_discovery import label_selector, exporter_url
from budgetgate.cli.main import cli
from budgetgate.cli.meter import _mig_slices, _restored, default_state


def test_the_state_is_kept_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_state("dcgm") == tmp_path / "budgetgate" / "meter-dcgm-dcgm.json"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state("gpu") == tmp_path / "home" / ".local" / "state" / "budgetgate" / "meter-dcgm-gpu.json"


def test_a_state_file_that_cannot_be_read_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    broken = tmp_path / "state.json"
    broken.write_text("{not json")
    from datetime import timedelta

    import click

    with pytest.raises(click.ClickException, match="cannot be read"):
        _restored(broken, timedelta(minutes=5))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "give the exporters: --url for each, or --discover NAMESPACE"),
        (["--url", "http://n:9400/metrics", "--state", "s.json", "--no-state"], "--state and --no-state together"),
        (["--url", "http://n:9400/metrics", "--mig-slices", "L40S"], "'L40S' is not MODEL=N"),
        (["--url", "http://n:9400/metrics", "--mig-slices", "L40S=0"], "'L40S=0' is not MODEL=N"),
        (["--discover", "gpu-operator", "--selector", "app!=dcgm"], "is not of the form name=value"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(args: list[str], says: str) -> None:
    result = CliRunner().invoke(cli, ["meter", "dcgm", *args])
    assert result.exit_code == 2 and says in result.output


def test_mig_slices_of_an_operators_own_model() -> None:
    assert _mig_slices(("L40S=4", "RTX PRO 6000=4")) == {"L40S": 4, "RTX PRO 6000": 4}


def exporter(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "nvidia-dcgm-exporter-x7k2p", "namespace": "gpu-operator"},
        "spec": {"nodeName": "gpu-node-a", "containers": [{"name": "exporter", "ports": [{"name": "metrics", "containerPort": 9500}]}]},
        "status": status,
    }


def test_an_exporter_pod_is_scraped_at_its_ip_and_metrics_port() -> None:
    assert exporter_url(exporter(phase="Running", podIP="10.1.2.3"), port=9400) == "http://10.1.2.3:9500/metrics"
    assert exporter_url(exporter(phase="Running", podIP="fd00::12"), port=9400) == "http://[fd00::12]:9500/metrics"
    unnamed = exporter(phase="Running", podIP="10.1.2.3")
    unnamed["spec"]["containers"][0]["ports"] = [{"containerPort": 9500}]
    assert exporter_url(unnamed, port=9400) == "http://10.1.2.3:9400/metrics"
    assert exporter_url(exporter(phase="Pending"), port=9400) is None
    deleting = exporter(phase="Running", podIP="10.1.2.3")
    deleting["metadata"]["deletionTimestamp"] = "2026-07-14T09:00:00Z"
    assert exporter_url(deleting, port=9400) is None


def test_the_exporter_selector_is_equality_terms() -> None:
    assert label_selector("app=nvidia-dcgm-exporter, tier = gpu") == {"app": "nvidia-dcgm-exporter", "tier": "gpu"}
    assert label_selector("app==dcgm") == {"app": "dcgm"}
    for bad in ("app", "app!=dcgm", "=dcgm"):
        with pytest.raises(ValueError, match="is not of the form name=value"):
            label_selector(bad)
