"""Where settings come from: variables, the dev stack's state file, and values derived from both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from budgetgate.runtime.settings import CommonSettings, fingerprint


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("BUDGETGATE_POSTGRES_DSN", "BUDGETGATE_REDIS_URL", "BUDGETGATE_REDIS_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".budgetgate").mkdir()
    state = {
        "settings": {"postgres_dsn": "postgresql://pg/derived", "redis_prefix": "stack"},
        "from_env": {"postgres_dsn": fingerprint("postgresql://pg/base")},
    }
    (tmp_path / ".budgetgate" / "dev.json").write_text(json.dumps(state))
    return tmp_path


def test_the_state_file_is_used_without_variables(checkout: Path) -> None:
    settings = CommonSettings()
    assert settings.postgres_dsn == "postgresql://pg/derived" and settings.redis_prefix == "stack"


def test_a_value_derived_from_the_variable_wins_while_the_variable_is_unchanged(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUDGETGATE_POSTGRES_DSN", "postgresql://pg/base")
    assert CommonSettings().postgres_dsn == "postgresql://pg/derived"


def test_a_changed_variable_wins_over_the_state_file(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUDGETGATE_POSTGRES_DSN", "postgresql://pg/elsewhere")
    monkeypatch.setenv("BUDGETGATE_REDIS_PREFIX", "mine")
    settings = CommonSettings()
    assert settings.postgres_dsn == "postgresql://pg/elsewhere" and settings.redis_prefix == "mine"


def test_defaults_without_a_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BUDGETGATE_POSTGRES_DSN", raising=False)
    assert CommonSettings().postgres_dsn == "postgresql://postgres@127.0.0.1:5432/postgres"


def test_the_reconciler_still_reads_its_port_and_host_under_their_older_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from budgetgate.services.reconciler.settings import ReconcilerSettings

    monkeypatch.chdir(tmp_path)
    for name in ("BUDGETGATE_PORT", "BUDGETGATE_HOST", "BUDGETGATE_METRICS_PORT", "BUDGETGATE_METRICS_HOST", "BUDGETGATE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert (ReconcilerSettings().host, ReconcilerSettings().port) == ("127.0.0.1", 9464)
    # What deployments set when it served only Prometheus metrics.
    monkeypatch.setenv("BUDGETGATE_METRICS_PORT", "9999")
    monkeypatch.setenv("BUDGETGATE_METRICS_HOST", "0.0.0.0")
    assert (ReconcilerSettings().host, ReconcilerSettings().port) == ("0.0.0.0", 9999)
    # The names every service reads win, and the command line's --host/--port over both.
    monkeypatch.setenv("BUDGETGATE_PORT", "8090")
    monkeypatch.setenv("BUDGETGATE_HOST", "127.0.0.2")
    assert (ReconcilerSettings().host, ReconcilerSettings().port) == ("127.0.0.2", 8090)
    assert ReconcilerSettings(port=7000).port == 7000


def test_group_timing_heartbeats_every_third_of_the_session_at_most_every_3_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BUDGETGATE_KAFKA_SESSION_TIMEOUT_MS", raising=False)
    assert CommonSettings().kafka_group_timing == {"session_timeout_ms": 10_000, "heartbeat_interval_ms": 3_000}
    monkeypatch.setenv("BUDGETGATE_KAFKA_SESSION_TIMEOUT_MS", "3000")
    assert CommonSettings().kafka_group_timing == {"session_timeout_ms": 3_000, "heartbeat_interval_ms": 1_000}
    monkeypatch.setenv("BUDGETGATE_KAFKA_SESSION_TIMEOUT_MS", "999")
    with pytest.raises(ValueError, match="kafka_session_timeout_ms"):
        CommonSettings()
