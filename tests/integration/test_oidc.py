"""OIDC bearer tokens: JWTs signed by a key this test generates, verified by admission against a
JWKS this test serves on loopback. A good token acts within its claimed role and namespaces; a
wrong audience, issuer, signature or an expired token is refused and changes nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.support.admission import admission_factory, apply_policies, example_policies, submission  # noqa: F401 - pytest fixtures
from tests.support.principals import bearer, ledger_state
from tests.support.oidc import AUDIENCE, ISSUER, Issuer
from tests.support.servers import PageServer


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    found = Issuer()
    yield found
    found.pages.close()


async def test_jwts_are_verified_against_the_issuers_jwks(admission_factory, issuer, pg_dsn, settings) -> None:
    await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
    server = await admission_factory(oidc_issuer=ISSUER, oidc_audience=AUDIENCE, oidc_jwks_url=issuer.jwks_url)
    await server.wait_ready()
    good = issuer.token(budgetgate_roles=["submitter"], budgetgate_namespaces=["vision-*"])
    allowed = await server.client.post("/v1/admissions", json=submission(run_id="jwt/ok"), headers=bearer(good))
    assert allowed.status_code == 200 and allowed.json()["decision"] == "ALLOW", allowed.text

    before = await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix)
    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    refused = {
        "wrong audience": issuer.token(aud="someone-else", budgetgate_roles=["submitter"]),
        "wrong issuer": issuer.token(iss="https://evil.test", budgetgate_roles=["submitter"]),
        "wrong signature": issuer.token(key=other_key, budgetgate_roles=["submitter"]),
        "expired": issuer.token(exp=int(time.time()) - 3600, budgetgate_roles=["submitter"]),
        "unsigned": jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": int(time.time()) + 60}, key=None, algorithm="none"),
        # RS256 naming the EC key: PyJWT cannot even prepare that key for it (once a 500).
        "algorithm of another key type": jwt.encode(
            {"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": int(time.time()) + 60, "budgetgate_roles": ["submitter"]},
            issuer.key,
            algorithm="RS256",
            headers={"kid": "k2"},
        ),  # fmt: skip
    }
    for why, token in refused.items():
        response = await server.client.post("/v1/admissions", json=submission(run_id=f"jwt/{why}"), headers=bearer(token))
        assert response.status_code == 401, (why, response.text)
        assert response.headers["www-authenticate"].startswith("Bearer") and response.headers["content-type"] == "application/problem+json"
    no_role = await server.client.post("/v1/admissions", json=submission(run_id="jwt/no-role"), headers=bearer(issuer.token()))
    assert no_role.status_code == 403 and "needs role submitter" in no_role.json()["detail"]
    outside = issuer.token(budgetgate_roles=["submitter"], budgetgate_namespaces=["nlp-*"])
    response = await server.client.post("/v1/admissions", json=submission(run_id="jwt/outside"), headers=bearer(outside))
    assert response.status_code == 403 and "namespace 'vision-prod'" in response.json()["detail"]
    assert await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix) == before


async def test_claims_are_mapped_by_settings_nested_ones_included(admission_factory, issuer, pg_dsn) -> None:
    await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
    server = await admission_factory(
        oidc_issuer=ISSUER, oidc_audience=AUDIENCE, oidc_jwks_url=issuer.jwks_url,
        oidc_roles_claim="groups", oidc_tenants_claim="platform.tenants",
    )  # fmt: skip
    await server.wait_ready()
    reader = issuer.token(groups="reader", platform={"tenants": ["nlp"]})
    assert (await server.client.get("/v1/tenants/nlp/usage", headers=bearer(reader))).status_code == 200
    refused = await server.client.get("/v1/tenants/vision/usage", headers=bearer(reader))
    assert refused.status_code == 403 and "jwt:system:serviceaccount:flyte:flyte-admin" in refused.json()["detail"]


async def test_a_key_set_that_is_not_json_is_a_401_naming_it(admission_factory, issuer, pg_dsn) -> None:
    # A proxy answering the issuer's JWKS URL with an HTML page: PyJWT raises a JSON error of
    # its own reading, which must not read as the token's fault (nor be a 500).
    html = PageServer(lambda _path: (b"<html>maintenance</html>", "text/html"))
    try:
        await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
        server = await admission_factory(oidc_issuer=ISSUER, oidc_audience=AUDIENCE, oidc_jwks_url=f"{html.url}/jwks.json")
        await server.wait_ready()
        token = issuer.token(budgetgate_roles=["submitter"])
        response = await server.client.post("/v1/admissions", json=submission(run_id="jwt/html"), headers=bearer(token))
        assert response.status_code == 401 and "key set could not be read" in response.json()["detail"], response.text
    finally:
        html.close()
