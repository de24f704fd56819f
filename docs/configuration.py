"""Write docs/configuration.md from the settings classes: `python docs/configuration.py`.

Every subclass of pydantic-settings' BaseSettings defined in the packages `budgetgate` and
`budgetgate.services` is found by walking them (pkgutil), so a settings class that moves to
another module is still found. A variable's meaning is its `Field(description=...)`, else the
comment right above the field in the class's source (a comment above a run of fields also
explains the later ones it names), else the same in a base class; MEANINGS below fills in the
few fields the code has no words for yet. tests/unit/test_configuration_docs.py fails when the
committed page differs from what this writes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import json
import pkgutil
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import SecretStr
from pydantic_settings import BaseSettings

PAGE = Path(__file__).resolve().parent / "configuration.md"
PACKAGES = ("budgetgate", "budgetgate.services")

# Fields without a comment or a description in the code, explained here until the code says it.
MEANINGS = {
    "BUDGETGATE_POSTGRES_DSN": "the ledger database: the one store to back up",
    "BUDGETGATE_REDIS_URL": "Redis for the atomic check-and-reserve (a live copy of the ledger, rebuilt from Postgres when lost); "
    "`redis+cluster://host:port` (or `rediss+cluster://`) names a Redis Cluster by one of its nodes",
    "BUDGETGATE_KAFKA_BOOTSTRAP": "Kafka bootstrap servers",
    "BUDGETGATE_TOPIC_REPLICATION_FACTOR": "replicas of the topics a service creates when they are missing; set it to your cluster's (e.g. 3)",
    "BUDGETGATE_ACCOUNTING_RESET_SECONDS": "how long the circuit breaker stays open before one trial ask",
    "BUDGETGATE_CONSUMER_GROUP": "the Kafka consumer group, under the topic prefix",
    "BUDGETGATE_SERVICE_NAME": "the name the process reports its traces and metrics under (OpenTelemetry's service.name)",
    "BUDGETGATE_KAFKA_SASL_MECHANISM": "the SASL mechanism: `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`",
    "BUDGETGATE_KAFKA_SASL_USERNAME": "the service's SASL user name",
    "BUDGETGATE_KAFKA_SASL_PASSWORD": "the service's SASL password",
    "BUDGETGATE_KAFKA_SSL_CAFILE": "the CA that signed the brokers' certificates (else the system's)",
    "BUDGETGATE_TLS_CERTFILE": "serve HTTPS with this certificate (PEM); with `BUDGETGATE_TLS_KEYFILE`, unset both for plain HTTP",
    "BUDGETGATE_TLS_KEYFILE": "the private key (PEM) of `BUDGETGATE_TLS_CERTFILE`",
    "BUDGETGATE_OIDC_ISSUER": "the `iss` JWTs must carry; unset, JWTs are not accepted (API tokens only)",
    "BUDGETGATE_OIDC_AUDIENCE": "the `aud` JWTs must carry",
    "BUDGETGATE_OIDC_JWKS_URL": "where the issuer's signing keys are (Kubernetes: `https://<api-server>/openid/v1/jwks`)",
    "BUDGETGATE_OIDC_ALGORITHMS": "accepted JWT signing algorithms",
    "BUDGETGATE_OIDC_SUBJECT_CLAIM": "the claim naming the caller (shown as `jwt:<value>`)",
    "BUDGETGATE_OIDC_ROLES_CLAIM": "the claim holding the caller's roles (a list, or a space-separated string; a dotted path reaches a nested claim)",
    "BUDGETGATE_OIDC_NAMESPACES_CLAIM": "the claim holding the namespace globs the caller is limited to (as the roles claim)",
    "BUDGETGATE_OIDC_TENANTS_CLAIM": "the claim holding the tenants the caller is limited to (as the roles claim)",
    "BUDGETGATE_HOST": "the address the HTTP server listens on",
    "BUDGETGATE_PORT": "the port the HTTP server listens on",
    "BUDGETGATE_PG_POOL_MIN": "Postgres connections the process keeps open",
    "BUDGETGATE_PG_POOL_MAX": "the most Postgres connections the process opens (keep replicas × this under Postgres's `max_connections`)",
    "BUDGETGATE_POLICY_REFRESH_SECONDS": (
        "how often the active policy bundle (with tenant overrides and fair-share usage) is read again from Postgres, besides the announcements"
        " on `budget.policies.v1`"
    ),
    "BUDGETGATE_MAX_BODY_BYTES": "the largest request body accepted, declared or streamed; larger is a 413",
    "BUDGETGATE_ACCOUNTING_TOKEN": "bearer token sent to `BUDGETGATE_ACCOUNTING_URL`",
    "BUDGETGATE_ACCOUNTING_TIMEOUT_SECONDS": "the whole ask's deadline; past it the ledger's own figure is used",
    "BUDGETGATE_ACCOUNTING_CACHE_SECONDS": "how long an answer is reused per tenant; failures are not cached",
    "BUDGETGATE_MAX_BATCH_SAMPLES": "the most samples one `POST /v1/metering/samples` may carry",
    "BUDGETGATE_INBOX_NAME": "the name the inbox records processed event ids under",
    "BUDGETGATE_EVIDENCE_FILE": "where events go when openlineage-python has no transport (no `OPENLINEAGE_URL`, `OPENLINEAGE_CONFIG`, openlineage.yml)",
    "BUDGETGATE_EVIDENCE_MAX_BACKOFF_SECONDS": "the longest wait between two delivery tries",
    "BUDGETGATE_EVIDENCE_BATCH": "events sent per delivery pass",
    "BUDGETGATE_EVIDENCE_IDLE_SECONDS": "how long the sender waits before looking again when nothing is left to send",
    "BUDGETGATE_KUBERNETES_GPU_RESOURCE": "the extended resource counted as GPUs",
    "BUDGETGATE_KUBERNETES_RUN_ID_ANNOTATION": "the annotation naming the run id (else the object's UID)",
    "BUDGETGATE_KUBERNETES_ATTEMPT_ANNOTATION": "the annotation naming the attempt (else 1)",
    "BUDGETGATE_KUBERNETES_RUNTIME_ANNOTATION": "the annotation giving the projected runtime in hours, for objects without `activeDeadlineSeconds`",
    "BUDGETGATE_KUBERNETES_FLAVOR_ANNOTATION": "the annotation naming the GPU flavor",
    "BUDGETGATE_KUBERNETES_REGION_ANNOTATION": "the annotation naming the region",
    "BUDGETGATE_KUBERNETES_DEFAULT_RUNTIME_HOURS": "hours assumed for objects with no deadline, annotation or namespace default; unset, they are denied",
    "BUDGETGATE_KUBERNETES_DEFAULT_FLAVOR": "the flavor of objects without the flavor annotation",
    "BUDGETGATE_KUBERNETES_SUBMIT_CPU_ONLY": "decide objects that ask for no GPU too (else they are allowed without a decision)",
    "BUDGETGATE_ADMISSION_URL": "where CLI commands and `budgetgate.client` reach admission (else the local stack's)",
}

# Read with os.environ, not by a settings class.
OTHER_VARIABLES = (
    ("BUDGETGATE_TOKEN", "the API token the CLI and `budgetgate.client` send as `Authorization: Bearer`", "the local stack's token of the role needed"),
    ("BUDGETGATE_HOME", "the folder of the local stack to use, instead of the nearest `.budgetgate/dev.json` at or above the current folder", "none"),
    ("BUDGETGATE_METERING_URL", "where `budgetgate.client` posts lifecycle events and metering samples", "the local stack's metering-ingest"),
)

HEADER = """\
# Configuration

<!-- Generated by docs/configuration.py from the settings classes; edit those, then run `python docs/configuration.py`. -->

Every budgetgate process reads `BUDGETGATE_*` environment variables, through the settings classes
below. Precedence: a variable set in the environment, then the state file of a local stack
(`.budgetgate/dev.json`, found in the current folder or a parent, or under `BUDGETGATE_HOME`), then
the defaults below. So a command run in a checkout where `budgetgate dev up` runs reaches that
stack with no variable set (see [the command line](cli.md)). Lists and objects are written as JSON
(`BUDGETGATE_TRUSTED_PROXIES='["10.0.0.0/8"]'`).

A service reads the variables of its own section and those of the shared sections it names. The
Kubernetes ConfigMap (`deploy/kubernetes/base/config.yaml`) and `docker-compose.yml` set them for
a deployment.
"""


class Variable(NamedTuple):
    env: str
    type: str
    default: str
    meaning: str


def _walk() -> list[str]:
    names: list[str] = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, f"{package_name}."):
            if info.name.rsplit(".", 1)[-1] != "__main__" and info.name not in names:
                names.append(info.name)
    return names


def settings_classes() -> list[type[BaseSettings]]:
    """Every BaseSettings subclass defined in the packages, bases before the classes built on them."""
    found: dict[str, type[BaseSettings]] = {}
    for name in _walk():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # an optional extra not installed: that module reads no settings here
            if exc.name and exc.name.split(".")[0] == "budgetgate":
                raise
            print(f"configuration: skipped {name} ({exc})", file=sys.stderr)
            continue
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseSettings) and value.__module__ == name and value is not BaseSettings:
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return sorted(found.values(), key=lambda cls: (len(cls.__mro__), cls.__module__, cls.__qualname__))


def _service(cls: type) -> str | None:
    parts = cls.__module__.split(".")
    return parts[2] if parts[:2] == ["budgetgate", "services"] and len(parts) > 2 else None


def _name(service: str) -> str:
    return service.replace("_", "-")


def _own_fields(cls: type[BaseSettings]) -> list[str]:
    own = cls.__dict__.get("__annotations__", {})
    return [name for name in cls.model_fields if name in own]


def _env(cls: type[BaseSettings], name: str) -> str:
    alias = cls.model_fields[name].validation_alias or cls.model_fields[name].alias
    if isinstance(alias, str):
        return alias.upper()
    return f"{cls.model_config.get('env_prefix', '')}{name}".upper()


def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment that explains it in the class's own source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines[token.start[0]] = token.string.lstrip("#").strip()
    code_lines = source.splitlines()
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    found: dict[str, str] = {}
    run_comment = ""
    previous_end = -1
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            previous_end = -1
            continue
        name = statement.target.id
        above: list[str] = []
        line = statement.lineno - 1
        while line in lines and code_lines[line - 1].lstrip().startswith("#"):
            above.insert(0, lines[line])
            line -= 1
        inline = [lines[n] for n in range(statement.lineno, statement.end_lineno + 1) if n in lines and n not in range(line + 1, statement.lineno)]
        own = " ".join(above + [c for c in inline if c and not c.startswith("fmt:")])
        if above:
            run_comment = own
        elif line != previous_end:  # a blank line or another statement ends the run
            run_comment = ""
        if own:
            found[name] = own
        elif run_comment and re.search(rf"\b{re.escape(name)}\b", run_comment):
            found[name] = run_comment
        previous_end = statement.end_lineno or statement.lineno
    return found


def _meaning(cls: type[BaseSettings], name: str) -> str:
    description = cls.model_fields[name].description
    if description:
        return description
    for klass in cls.__mro__:
        if isinstance(klass, type) and issubclass(klass, BaseSettings) and name in klass.__dict__.get("__annotations__", {}):
            comment = _comments(klass).get(name)
            if comment:
                return comment
    return MEANINGS.get(_env(cls, name), "")


_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean", SecretStr: "string (secret)"}
_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def _type(annotation: Any, metadata: Any = (), *, plural: bool = False) -> str:
    """How a person writes the variable's value: `integer ≥ 1`, `one of a, b`, `JSON list of strings`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a, plural=plural) for a in args if a is not type(None))
    if origin is typing.Annotated:
        return _type(args[0], [m for a in args[1:] for m in getattr(a, "metadata", [a])], plural=plural)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (list, tuple):
        items = [a for a in args if a is not Ellipsis]
        size = f"{len(items)} " if origin is tuple and Ellipsis not in args else ""
        return f"JSON list of {size}{' or '.join(sorted({_type(a, plural=True) for a in items}))}"
    if origin is dict:
        return "JSON object"
    text = _SIMPLE.get(annotation, getattr(annotation, "__name__", str(annotation)))
    if plural:
        text = text.replace("string", "strings").replace("integer", "integers").replace("number", "numbers").replace("boolean", "booleans")
    limits = [f"{sign} {getattr(m, key):g}" for m in metadata for key, sign in _BOUNDS.items() if getattr(m, key, None) is not None]
    return f"{text} {', '.join(limits)}" if limits else text


def _human(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    if name.endswith("_seconds") and value >= 3600:
        for size, unit in ((86400, "day"), (3600, "hour")):
            if value % size == 0:
                count = int(value // size)
                return f" ({count} {unit}{'s' if count != 1 else ''})"
    if name.endswith("_bytes") and value >= 1024 and value % 1024 == 0:
        return f" ({value // 1048576} MiB)" if value % 1048576 == 0 else f" ({value // 1024} KiB)"
    return ""


def _default(cls: type[BaseSettings], name: str) -> str:
    field = cls.model_fields[name]
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is None:
        return "none"
    if isinstance(value, SecretStr):
        return "(set)"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list | tuple | dict):
        return f"`{json.dumps(value, separators=(', ', ': '))}`"
    return f"`{value}`{_human(name, value)}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _variables(cls: type[BaseSettings], names: list[str]) -> list[Variable]:
    return [Variable(_env(cls, n), _type(cls.model_fields[n].annotation, cls.model_fields[n].metadata), _default(cls, n), _meaning(cls, n)) for n in names]


def _table(variables: list[Variable]) -> list[str]:
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.env}` | {_cell(v.type)} | {_cell(v.default)} | {_cell(v.meaning)} |" for v in variables]
    return rows


def _summary(cls: type) -> str:
    doc = inspect.getdoc(cls) if cls.__doc__ else None
    if not doc:
        return ""
    return " ".join(doc.split())


def _sections() -> list[tuple[str, str, list[str], list[Variable]]]:
    """(heading, anchor, text lines, variables) per section: shared classes first, then each service."""
    classes = settings_classes()
    served = {base for c in classes if _service(c) for base in c.__mro__}
    # Shared classes some service reads first (bases before the classes built on them), then those only the command line reads.
    shared = sorted((c for c in classes if _service(c) is None), key=lambda c: (c not in served, len(c.__mro__), c.__module__, c.__qualname__))
    services = sorted({s for c in classes if (s := _service(c))})
    sections = []
    for cls in shared:
        fields = _own_fields(cls)
        if not fields:
            continue
        users = sorted({s for c in classes if (s := _service(c)) and issubclass(c, cls)})
        text = [_summary(cls)] if _summary(cls) else []
        where = f"`{cls.__module__}.{cls.__qualname__}`"
        links = ", ".join(f"[{_name(u)}](#{_name(u)})" for u in users)
        text.append(f"Read by: {links} ({where})." if users else f"Read by the command line ({where}).")
        sections.append((cls.__qualname__, cls.__qualname__.lower(), text, _variables(cls, fields)))
    for service in services:
        seen: set[str] = set()
        variables: list[Variable] = []
        mine = sorted(
            (c for c in classes if _service(c) == service), key=lambda c: (c.__module__.rsplit(".", 1)[-1] != "settings", c.__module__, c.__qualname__)
        )
        bases: list[str] = []
        for cls in mine:
            for base in cls.__mro__[1:]:
                if base in shared and base.__qualname__ not in bases and _own_fields(base):
                    bases.append(base.__qualname__)
            for v in _variables(cls, _own_fields(cls)):
                if v.env not in seen:
                    seen.add(v.env)
                    variables.append(v)
        where = ", ".join(f"`{c.__module__}.{c.__qualname__}`" for c in mine)
        text = [f"Its own variables ({where}); it also reads {', '.join(f'[{b}](#{b.lower()})' for b in bases)}." if bases else f"({where})"]
        sections.append((_name(service), _name(service), text, variables))
    return sections


def variables() -> list[Variable]:
    """Every variable the page lists, in its order."""
    return [v for *_, found in _sections() for v in found]


def render() -> str:
    out = [HEADER]
    sections = _sections()
    out.append("| section | variables |\n|---|---|")
    out += [f"| [{heading}](#{anchor}) | {len(found)} |" for heading, anchor, _, found in sections]
    for heading, _anchor, text, found in sections:
        out.append(f"\n## {heading}\n")
        out += [line + "\n" for line in text]
        out += _table(found)
    out.append("\n## Read outside the settings classes\n")
    out += _table([Variable(env, "string", default, meaning) for env, meaning, default in OTHER_VARIABLES])
    return "\n".join(out) + "\n"


def main() -> None:
    text = render()
    unexplained = [v.env for v in variables() if not v.meaning]
    if unexplained:
        print(f"configuration: no meaning in the code for {', '.join(unexplained)}", file=sys.stderr)
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({len(variables())} variables)")


if __name__ == "__main__":
    main()
