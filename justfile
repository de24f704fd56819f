# Everyday commands. `just --list` shows them; each one is also runnable by hand.

venv := ".venv"
python := venv / "bin/python"
budgetgate := venv / "bin/budgetgate"

# Create the virtualenv; install the project, its dev tools and the flyte extra at CI's pins.
setup:
    test -x {{python}} || python3 -m venv {{venv}}
    {{python}} -m pip install --quiet -e '.[dev,flyte]' -c constraints/dev-flyte.txt

# After a change to pyproject.toml's dependencies (needs uv: `pip install uv`):
# Resolve the dev and flyte extras again into constraints/dev-flyte.txt.
lock:
    uv pip compile pyproject.toml --extra dev --extra flyte --universal --python-version 3.11 -o constraints/dev-flyte.txt

# Run the whole test suite (it starts the servers it needs); extra arguments go to pytest.
test *args:
    {{python}} -m pytest {{args}}

# The ledger suites again, on an embedded Redis Cluster (three masters with a replica each).
test-cluster *args:
    BUDGETGATE_TEST_REDIS=cluster {{python}} -m pytest -m ledger {{args}}

# Apply the example policies to the local stack and submit a mix of workloads.
demo *args:
    {{budgetgate}} demo {{args}}

# Start the local stack in the background (Postgres, Redis, Kafka and the services).
up *args:
    {{budgetgate}} dev up --detach {{args}}

# Stop what `just up` started.
down:
    {{budgetgate}} dev down

# Show the local stack: URLs, and which processes are alive.
status:
    {{budgetgate}} dev status

# Regenerate the Python code of the wire contracts in proto/.
proto:
    {{python}} -m budgetgate.contracts.build

# Benchmarks (outside the test run).
bench *args:
    {{budgetgate}} bench admission {{args}}

# What CI checks before the tests: ruff's lint rules, `ruff format`, the import layers and the documentation site.
lint:
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .
    {{venv}}/bin/lint-imports
    NO_MKDOCS_2_WARNING=1 {{venv}}/bin/mkdocs build --strict

# Rewrite the tree as `ruff format` wants it.
fmt:
    {{venv}}/bin/ruff format .

# Serve the documentation site (docs/, mkdocs.yml) on http://127.0.0.1:8000, rebuilt on every change.
docs *args:
    NO_MKDOCS_2_WARNING=1 {{venv}}/bin/mkdocs serve {{args}}
