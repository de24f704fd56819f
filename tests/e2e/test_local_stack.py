"""The whole local stack from the command line: dev up, policy apply at a Git SHA, submissions
over HTTP, the decision on budget.decisions.v1 with the same decision id, dev down."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx

from budgetgate.contracts.topics import Topics
from tests.support.admission import EXAMPLES, decisions_on, submission
from tests.support.policy_repos import git
from tests.support.waiting import wait_for
from tests.support.cli import budgetgate


async def test_dev_up_apply_submit_publish_down(tmp_path: Path) -> None:
    workdir = tmp_path / "checkout"
    policies = workdir / "policies"
    shutil.copytree(EXAMPLES, policies)
    git("init", "-q", cwd=workdir)
    git("-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-q", "--allow-empty", "-m", "init", cwd=workdir)
    git("add", ".", cwd=workdir)
    git("-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-q", "-m", "policies", cwd=workdir)
    sha = git("rev-parse", "HEAD", cwd=workdir)

    up = budgetgate("dev", "up", "--detach", cwd=workdir)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        status = budgetgate("dev", "status", "--json", cwd=workdir)
        assert status.returncode == 0, status.stderr
        state = json.loads(status.stdout)
        for field in ("admission_url", "kafka_bootstrap", "postgres_dsn", "redis_url"):
            assert state[field], field

        (policies / "teams" / "vision.yaml").write_text((policies / "teams" / "vision.yaml").read_text() + "\n# edited\n")
        dirty = budgetgate("policy", "apply", "policies", cwd=workdir)
        assert dirty.returncode != 0 and "uncommitted" in dirty.stderr
        git("checkout", "--", ".", cwd=workdir)
        applied = budgetgate("policy", "apply", "policies", cwd=workdir)
        assert applied.returncode == 0, applied.stderr
        assert sha in applied.stdout

        async with httpx.AsyncClient(
            base_url=state["admission_url"], timeout=30, headers={"Authorization": f"Bearer {state['tokens']['submitter']}"}
        ) as client:

            async def deciding() -> bool:
                ready = await client.get("/readyz")
                return ready.status_code == 200 and ready.json()["checks"]["policy_bundle"] == "ok"

            await wait_for(deciding, timeout=30, what="admission ready with the policy bundle applied")
            answers = {}
            for run_id, overrides in {
                "e2e/allow": {},
                "e2e/violation": {"labels": {"team": "vision"}},
                "e2e/deny": {"resources": {"gpus": 64, "flavor": "h100"}, "projected_runtime_hours": 10.0},
            }.items():
                response = await client.post("/v1/admissions", json=submission(run_id=run_id, **overrides))
                assert response.status_code == 200, response.text
                answers[run_id] = response.json()
        assert [a["decision"] for a in answers.values()] == ["ALLOW", "DENY", "DENY"]
        assert all(a["policy_bundle_sha"] == sha for a in answers.values())

        topic = Topics(state.get("topic_prefix", "")).decisions
        published = await decisions_on(state["kafka_bootstrap"], topic, set(answers))
        assert set(published) == set(answers)
        for run_id, answer in answers.items():
            assert published[run_id].decision_id == answer["decision_id"]
            assert published[run_id].policy_bundle_sha == sha
    finally:
        down = budgetgate("dev", "down", cwd=workdir)
    assert down.returncode == 0, down.stderr
    assert budgetgate("dev", "status", "--json", cwd=workdir).returncode != 0
