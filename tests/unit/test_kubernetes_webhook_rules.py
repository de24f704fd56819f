"""deploy/kubernetes/webhook against the mapping it serves: the ValidatingWebhookConfiguration
sends every kind budgetgate admits on CREATE, and the scalable ones on UPDATE; the webhook stays
ready while it can answer; the token the API server must present is documented."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from budgetgate.platforms.flyte_workflows import GROUP as FLYTE_GROUP
from budgetgate.platforms.flyte_workflows import KIND as FLYTE_KIND
from budgetgate.platforms.kubernetes import ADMITTED_KINDS, ADMITTED_OWNERS, SCALABLE_KINDS
from budgetgate.platforms.reviews import ANSWERED_VERSION
from tests.support.kubernetes import GROUPS

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
WEBHOOK = KUBERNETES / "webhook"


def _doc(name: str, kind: str) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all((WEBHOOK / name).read_text()) if d["kind"] == kind)


def test_the_rules_send_what_the_mapping_checks() -> None:
    (hook,) = _doc("validatingwebhookconfiguration.yaml", "ValidatingWebhookConfiguration")["webhooks"]
    operations: dict[tuple[str, str], set[str]] = {}
    for rule in hook["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                operations.setdefault((group, resource), set()).update(rule["operations"])
    resource_of = {(group, kind): resource for kind, (group, _version, resource) in GROUPS.items()}
    assert set(resource_of) == ADMITTED_KINDS
    # Every kind on UPDATE: the scalable ones for their GPUs, all for their run id label (a Pod
    # only for that: its match condition sends no other update of a Pod).
    assert SCALABLE_KINDS < ADMITTED_KINDS
    expected = {resource_of[k]: {"CREATE", "UPDATE"} for k in ADMITTED_KINDS}
    # A FlyteWorkflow (flyte_workflows) on CREATE alone: flytepropeller writes its status into it.
    expected["flyteworkflows"] = {"CREATE"}
    assert {resource: ops for (_group, resource), ops in operations.items()} == expected
    assert any(c["name"] == "pod-updates-renaming-the-run" for c in hook["matchConditions"])
    assert {group for group, _ in operations} == {group for group, _ in ADMITTED_KINDS} | {FLYTE_GROUP}
    # The pods flytepropeller creates pass on their FlyteWorkflow, whose CREATE is sent.
    assert (FLYTE_GROUP, FLYTE_KIND) in ADMITTED_OWNERS


def test_the_api_server_is_asked_to_send_the_one_version_answered() -> None:
    # Another version is a 400 (the API server cannot read a v1 answer to it): the configuration
    # must name v1 alone, or an API server preferring another would fail every call.
    (hook,) = _doc("validatingwebhookconfiguration.yaml", "ValidatingWebhookConfiguration")["webhooks"]
    assert [f"admission.k8s.io/{v}" for v in hook["admissionReviewVersions"]] == [ANSWERED_VERSION]


def test_the_webhook_is_ready_while_it_answers_not_while_the_ledger_does() -> None:
    # /readyz fails with the ledger: no endpoints, and failurePolicy Fail blocks every pod.
    hook = _doc("validatingwebhookconfiguration.yaml", "ValidatingWebhookConfiguration")["webhooks"][0]
    (container,) = _doc("webhook-deployment.yaml", "Deployment")["spec"]["template"]["spec"]["containers"]
    assert hook["failurePolicy"] == "Fail" and container["readinessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_token_the_api_server_presents_is_documented() -> None:
    (hook,) = _doc("validatingwebhookconfiguration.yaml", "ValidatingWebhookConfiguration")["webhooks"]
    service = hook["clientConfig"]["service"]
    assert service["port"] == 443  # else the kubeconfig user's name carries the port
    user = f"name: {service['name']}.{service['namespace']}.svc"
    for text in ((WEBHOOK / "validatingwebhookconfiguration.yaml").read_text(), (KUBERNETES / "README.md").read_text()):
        assert "kind: WebhookAdmissionConfiguration" in text and "kubeConfigFile:" in text and user in text and "token:" in text
        assert "--role submitter" in text
    # Both webhooks are called with the token: the mutating one's plugin names the kubeconfig too.
    readme = (KUBERNETES / "README.md").read_text()
    assert "name: MutatingAdmissionWebhook" in readme and "name: ValidatingAdmissionWebhook" in readme
    assert readme.count("kubeConfigFile: /etc/kubernetes/budgetgate-webhook.kubeconfig") == 2
