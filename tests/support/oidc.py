"""An OIDC issuer for tests: a signing key (and an EC key beside it) whose JWKS is served over
HTTP on 127.0.0.1, and the JWTs it signs."""

from __future__ import annotations

import json
import time
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from tests.support.servers import PageServer

ISSUER = "https://issuer.test"
AUDIENCE = "budgetgate"


class Issuer:
    """An OIDC issuer's signing key and its JWKS, served over HTTP on 127.0.0.1."""

    def __init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        # An EC key beside it, as issuers rotating between key types publish.
        self.ec_key = ec.generate_private_key(ec.SECP256R1())
        ec_jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.ec_key.public_key()))
        body = json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig", "alg": "RS256"}, {**ec_jwk, "kid": "k2", "use": "sig", "alg": "ES256"}]}).encode()
        self.pages = PageServer(lambda _path: (body, "application/json"))
        self.jwks_url = f"{self.pages.url}/jwks.json"

    def token(self, *, key: Any = None, **claims: Any) -> str:
        now = int(time.time())
        payload = {"iss": ISSUER, "aud": AUDIENCE, "sub": "system:serviceaccount:flyte:flyte-admin", "iat": now, "exp": now + 600, **claims}
        return jwt.encode(payload, key or self.key, algorithm="RS256", headers={"kid": "k1"})
