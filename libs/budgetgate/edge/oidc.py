"""OIDC / JWT bearer tokens (Kubernetes projected service-account tokens included), verified
with PyJWT against the issuer's JWKS: signature, issuer, audience and expiry."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jwt

from budgetgate.core.principals import Principal, Unauthenticated


@dataclass(frozen=True)
class ClaimMapping:
    """Which claims name the principal, its roles, namespaces and tenants. A claim may be a
    dotted path into nested claims (`kubernetes.io.namespace`)."""

    subject: str = "sub"
    roles: str = "budgetgate_roles"
    namespaces: str = "budgetgate_namespaces"
    tenants: str = "budgetgate_tenants"
    # Roles granted to a subject by configuration, for tokens that carry no role claim
    # (Kubernetes service-account tokens: `system:serviceaccount:<namespace>:<name>`).
    subject_roles: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


class JwtVerifier:
    def __init__(self, *, issuer: str, audience: str, jwks_url: str, algorithms: list[str], claims: ClaimMapping, leeway_seconds: float = 30.0) -> None:
        self.issuer = issuer
        self.audience = audience
        self.algorithms = algorithms
        self.claims = claims
        self.leeway = leeway_seconds
        self.jwks = jwt.PyJWKClient(jwks_url, cache_keys=True, lifespan=300, timeout=5)

    async def principal(self, token: str) -> Principal:
        """The principal of a verified token; raises Unauthenticated saying why not."""
        try:
            # PyJWKClient fetches with urllib (blocking) on a cache miss.
            key = await asyncio.to_thread(self.jwks.get_signing_key_from_jwt, token)
        except jwt.PyJWKClientError as exc:
            raise Unauthenticated(f"bearer token: signing key not found ({exc})") from None
        except jwt.PyJWTError as exc:  # a token whose header cannot be read
            raise Unauthenticated(f"bearer token rejected: {exc}") from None
        except ValueError as exc:  # the key set came back as something other than JSON
            raise Unauthenticated(f"bearer token: signing key not found (the issuer's key set could not be read: {exc})") from None
        try:
            claims = jwt.decode(
                token, key.key, algorithms=self.algorithms, audience=self.audience, issuer=self.issuer, leeway=self.leeway,
                options={"require": ["exp", "iss", "aud"]},
            )  # fmt: skip
        except jwt.PyJWTError as exc:
            raise Unauthenticated(f"bearer token rejected: {exc}") from None
        except (TypeError, ValueError):
            # An algorithm that does not fit the type of the key the token names (RS256 on an EC
            # key): PyJWT fails preparing the key, before any signature is checked.
            raise Unauthenticated("bearer token rejected: its algorithm does not fit the type of its signing key") from None
        return principal_from_claims(claims, self.claims)


def principal_from_claims(claims: Mapping[str, Any], mapping: ClaimMapping) -> Principal:
    subject = _claim(claims, mapping.subject)
    if not isinstance(subject, str) or not subject:
        raise Unauthenticated(f"bearer token has no {mapping.subject!r} claim")
    try:
        roles = [*_strings(_claim(claims, mapping.roles)), *mapping.subject_roles.get(subject, ())]
        return Principal.of(f"jwt:{subject}", roles, namespaces=_strings(_claim(claims, mapping.namespaces)), tenants=_strings(_claim(claims, mapping.tenants)))
    except ValueError as exc:
        raise Unauthenticated(f"bearer token claim {mapping.roles!r}: {exc}") from None


def _claim(claims: Any, path: str) -> Any:
    """The claim at a dotted path; a key that has dots itself (`kubernetes.io`) is matched whole,
    the longest one first."""
    if not isinstance(claims, Mapping):
        return None
    if path in claims:
        return claims[path]
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:i])
        if head in claims:
            return _claim(claims[head], ".".join(parts[i:]))
    return None


def _strings(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v for v in value.replace(",", " ").split() if v]
    return [str(v) for v in value]
