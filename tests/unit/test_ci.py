""".ci/run's time limit: a test run stopped by `timeout` tears its fixtures down (tests/conftest.py
turns SIGTERM into an interrupt), and what still runs afterwards is found and stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from tests.support.waiting import wait_for_sync

ROOT = Path(__file__).resolve().parents[2]

# A run whose session fixture starts a "server" in a session of its own (as the embedded
# Postgres, Redis and Tansu are started) and stops it in its teardown.
SESSION = textwrap.dedent("""
    import os, subprocess, time
    from pathlib import Path

    import pytest

    OUT = Path(os.environ["CI_TEST_OUT"])


    @pytest.fixture(scope="session")
    def server():
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        (OUT / "server.pid").write_text(str(proc.pid))
        yield proc
        proc.kill()
        proc.wait()
        (OUT / "torn-down").write_text("yes")


    def test_runs_long(server):
        (OUT / "started").write_text("yes")
        time.sleep(120)  # the scenario: a test still running when the SIGTERM comes
""")


def _written(path: Path, proc: subprocess.Popen[str]) -> bool:
    if path.exists():
        return True
    assert proc.poll() is None, f"pytest ended before {path.name}: {proc.communicate()}"
    return False


def _ignores_sigterm(pid: int) -> bool:
    ignored = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:"))
    return bool(int(ignored, 16) & (1 << (signal.SIGTERM - 1)))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_run_stopped_by_timeout_tears_its_fixtures_down(tmp_path: Path, workers: str) -> None:
    (tmp_path / "test_long.py").write_text(SESSION)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "CI_TEST_OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    # As .ci/run does it: `timeout` signals pytest, then its whole process group (xdist's workers).
    command = ["timeout", "--kill-after=30", "300", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-n", workers]
    proc = subprocess.Popen([*command, "test_long.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = None
    try:
        wait_for_sync(lambda: _written(tmp_path / "started", proc), what="the long test started")
        server = int((tmp_path / "server.pid").read_text())
        proc.send_signal(signal.SIGTERM)  # what `timeout` sends on its own when the time is up
        output, _ = proc.communicate(timeout=60)
        assert (tmp_path / "torn-down").exists(), output
        assert not _alive(server)
        assert "KeyboardInterrupt" in output or "interrupted" in output, output
    finally:
        proc.kill()
        proc.wait()
        if server is not None and _alive(server):
            os.kill(server, signal.SIGKILL)


def test_leftovers_of_a_run_are_stopped_and_nothing_else(tmp_path: Path) -> None:
    marker = f"ci-test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "BUDGETGATE_CI_RUN": marker}
    # A server of the run that shrugs SIGTERM off (SIGKILL must follow), one that stops on it,
    # and a process of someone else's that must be left alone.
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 300"], env=env, start_new_session=True)
    polite = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], env={**os.environ, "BUDGETGATE_CI_RUN": marker + "-other"}, start_new_session=True)
    try:
        wait_for_sync(lambda: _ignores_sigterm(stubborn.pid), timeout=10, what="the stubborn one to set its trap")
        result = subprocess.run(
            [str(ROOT / ".ci" / "stop-leftovers"), marker], capture_output=True, text=True, timeout=60, env={**os.environ, "CI_STOP_GRACE_SECONDS": "1"}
        )
        assert result.returncode == 0, result.stderr
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
        assert polite.wait(timeout=5) == -signal.SIGTERM
        assert bystander.poll() is None
        assert f"pid {stubborn.pid}:" in result.stdout and f"pid {polite.pid}:" in result.stdout and f"pid {bystander.pid}:" not in result.stdout
        again = subprocess.run([str(ROOT / ".ci" / "stop-leftovers"), marker], capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and again.stdout == ""
    finally:
        for proc in (stubborn, polite, bystander):
            proc.kill()
            proc.wait()


def test_ci_run_marks_the_test_run_and_stops_its_leftovers() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    # The run of the whole suite (a collection ahead of it starts no servers).
    run = next(line for line in script.splitlines() if "-m pytest" in line and "PYTEST_ADDOPTS" in line)
    assert run.lstrip().startswith('BUDGETGATE_CI_RUN="$run_id" timeout '), run
    assert '.ci/stop-leftovers "$run_id"' in script
    # The ledger suites on a Redis Cluster, beside the fault campaign: marked as a run of their
    # own, waited for, stopped afterwards (and when the campaign fails), and counted in the outcome.
    cluster = next(line for line in script.splitlines() if line.lstrip().startswith("BUDGETGATE_CI_RUN=") and "BUDGETGATE_TEST_REDIS=cluster" in line)
    assert cluster.lstrip().startswith('BUDGETGATE_CI_RUN="$cluster_run" BUDGETGATE_TEST_REDIS=cluster timeout '), cluster
    assert script.index("cluster=$!") < script.index("budgetgate chaos run") < script.index('wait "$cluster"')
    assert script.count('.ci/stop-leftovers "$cluster_run"') == 1
    assert 'if [ "$cluster_status" -ne 0 ]; then' in script
    # The fault campaign beside the suite: started before it, marked as a run of its own, waited
    # for and its leftovers stopped after it, and counted in the outcome.
    suite = script.index(run)
    chaos = next(line for line in script.splitlines() if "budgetgate chaos run" in line)
    assert chaos.lstrip().startswith('BUDGETGATE_CI_RUN="$chaos_run" timeout ')
    assert script.index("chaos=$!") < suite < script.index('wait "$chaos"') < script.index('.ci/stop-leftovers "$chaos_run"')
    assert 'elif [ "$chaos_status" -ne 0 ]; then' in script
    # The suite is collected (its modules compiled) beside the checks, and done before anything
    # else imports them: the cluster run, the campaign's services and the suite's workers.
    assert script.index("--collect-only") < script.index("ruff check") < script.index('wait "$collecting"') < script.index("cluster=$!")
    assert "export UV_COMPILE_BYTECODE=1" not in script  # (every dependency compiled ahead cost 20 s of the 20 minutes)
    # pytest's "no tests collected" still fails CI.
    assert '5) log "FAILED: pytest collected no tests' in script


FAILS_THEN_HANGS = textwrap.dedent("""
    import os, time
    from pathlib import Path

    def test_fails():
        assert 1 == 2

    def test_hangs():
        (Path(os.environ["CI_TEST_OUT"]) / "started").write_text("yes")
        time.sleep(120)
""")


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_failure_is_named_before_a_run_is_cut_off(tmp_path: Path, workers: str) -> None:
    """A run killed outright (SIGKILL: no summary) has already printed which test failed."""
    (tmp_path / "test_cut.py").write_text(FAILS_THEN_HANGS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "CI_TEST_OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-n", workers, "test_cut.py"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        # (with xdist the worker's report reaches the controller a moment after the test ran)
        wait_for_sync(lambda: _written(tmp_path / "started", proc), what="the hanging test started")
        wait_for_sync(lambda: any("FAILED test_cut.py::test_fails" in line for line in lines), timeout=60, what="the failure named while the run goes on")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=30)
        proc.stdout.close()
    assert "short test summary" not in "".join(lines)  # (killed before it: the name came from the hook)
