# One image for the four services, the CLI and the one-shot jobs (migrate, topics, policies);
# docker-compose.yml and deploy/kubernetes/ pick what to run with `command`.
#
# Two stages: the first builds the wheel and installs it with its dependencies into a virtualenv,
# the second copies only that virtualenv. The embedded servers of the local stack
# (`budgetgate[local]`) are not installed: containers use real Postgres, Redis and Kafka.
# Every dependency is installed at the version CI tests (.ci/run installs with the same
# constraints file), never at whatever is newest on the day the image is built.
# tests/unit/test_image.py checks what this file copies against .dockerignore and the wheel.
FROM python:3.11-slim AS build

WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY constraints/dev-flyte.txt constraints/
COPY libs/ libs/
COPY services/ services/
RUN python -m venv /opt/budgetgate \
    && /opt/budgetgate/bin/pip install --no-compile -c constraints/dev-flyte.txt . \
    && /opt/budgetgate/bin/budgetgate --help >/dev/null

FROM python:3.11-slim

# git: `budgetgate policy apply` reads the policy repository's HEAD SHA. The repository is
# mounted and owned by another user, so git must trust it (read-only use). /run/budgetgate: the
# compose stack's operator-token volume is mounted there, and a new volume takes the owner and
# mode of the folder it is first mounted on, so the unprivileged user can write the token.
RUN apt-get update \
    && apt-get install -y --no-install-recommends git \
    && rm -rf /var/lib/apt/lists/* \
    && git config --system safe.directory '*' \
    && groupadd --system --gid 10001 budgetgate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin budgetgate \
    && install -d -o 10001 -g 10001 -m 0700 /run/budgetgate
COPY --from=build /opt/budgetgate /opt/budgetgate
ENV PATH=/opt/budgetgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BUDGETGATE_HOST=0.0.0.0
WORKDIR /app
# Runs unprivileged; nothing is written inside the image at run time.
USER 10001:10001

EXPOSE 8080 8081 8082 9464
# Every HTTP-serving process answers /healthz on BUDGETGATE_PORT; the reconciler, which serves
# only /metrics, gets its own check in docker-compose.yml and the Kubernetes manifests.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=6 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('BUDGETGATE_PORT', '8080')}/healthz\", timeout=4).status != 200)"]
CMD ["budgetgate", "--help"]
