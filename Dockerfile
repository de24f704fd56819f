# One image for the four services, the CLI and the one-shot jobs (migrate, topics);
# docker-compose.yml picks what to run with `command`.
FROM python:3.11-slim AS build

WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY libs/ libs/
COPY services/ services/
COPY proto/ proto/
RUN python -m venv /opt/budgetgate \
    && /opt/budgetgate/bin/pip install --no-compile .

FROM python:3.11-slim

# Runs unprivileged; nothing is written inside the image at run time.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin budgetgate
COPY --from=build /opt/budgetgate /opt/budgetgate
ENV PATH=/opt/budgetgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
USER budgetgate

EXPOSE 8080
CMD ["budgetgate", "--help"]
