#!/bin/sh
# budgetgate policy check for a policy repository's pull requests: validate the candidate
# policies, show the plan against the active bundle, and replay the last period's recorded
# submissions against them (what-if). Needs only `budgetgate` on PATH and read access to the
# ledger's Postgres (BUDGETGATE_POSTGRES_DSN); nothing live is changed.
#
#   policy-check.sh [POLICY_DIR] [SINCE]      (defaults: policies 30d)
#
# Writes a Markdown summary to $BUDGETGATE_SUMMARY (default budgetgate-summary.md), appends it
# to $GITHUB_STEP_SUMMARY when set, and exits non-zero when validation fails, or when decisions
# would flip and BUDGETGATE_FAIL_ON_FLIPS=1. Decisions what-if does not simulate (refused by a
# tenant quota, the sensitive pool or a token pool) are listed apart and never count as flips.
# The candidate is the working tree, uncommitted changes included, for diff and what-if alike.
set -eu

DIR=${1:-policies}
SINCE=${2:-30d}
SUMMARY=${BUDGETGATE_SUMMARY:-budgetgate-summary.md}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

budgetgate policy validate "$DIR" > "$WORK/validate.txt" 2>&1 || {
  { echo "## budgetgate: policy validation failed"; echo '```'; cat "$WORK/validate.txt"; echo '```'; } > "$SUMMARY"
  cat "$SUMMARY"
  exit 1
}
budgetgate policy diff "$DIR" > "$WORK/diff.txt"
budgetgate policy what-if "$DIR" --since "$SINCE" --json > "$WORK/what-if.json"

python3 - "$WORK/validate.txt" "$WORK/diff.txt" "$WORK/what-if.json" "$SUMMARY" <<'PY'
import json, sys

validate, diff, what_if, summary = sys.argv[1:5]
report = json.load(open(what_if))
lines = ["## budgetgate policy check", "", open(validate).read().strip(), "", "### Plan against the active bundle", "```", open(diff).read().rstrip(), "```", ""]
skipped = report.get("not_simulated", [])
by = ", ".join(f"{n} by {factor}" for factor, n in report.get("not_simulated_by", {}).items())
lines.append(
    f"### What-if since {report['since']}: {report['decisions']} recorded decisions, {len(report['flips'])} would flip"
    + (f", {len(skipped)} not simulated ({by})" if skipped else "")
)
if report["flips"]:
    lines += ["", "| run | attempt | decided at | before | after |", "|---|---|---|---|---|"]
    lines += [f"| `{f['run_id']}` | {f['attempt']} | {f['decided_at']} | {f['before']} | {f['after']} |" for f in report["flips"][:50]]
    if len(report["flips"]) > 50:
        lines.append(f"| … {len(report['flips']) - 50} more | | | | |")
if skipped:
    lines += ["", "Not simulated (what-if models budgets only; history's outcome is kept and never counted as a flip):", ""]
    lines += ["| run | attempt | decided at | outcome | decided by | the candidate's budgets alone |", "|---|---|---|---|---|---|"]
    lines += [f"| `{n['run_id']}` | {n['attempt']} | {n['decided_at']} | {n['outcome']} | {n['decided_by']} | {n['budgets_after'] or 'cannot price it'} |" for n in skipped[:50]]
    if len(skipped) > 50:
        lines.append(f"| … {len(skipped) - 50} more | | | | | |")
lines += ["", "| budget | admitted GPU-hours | change | showback cost change | exhausted at |", "|---|---|---|---|---|"]
for b in report["by_budget"]:
    cost = "" if b["showback_cost_change"] is None else f"{b['showback_cost_change']:+.2f} {b['currency'] or ''}"
    lines.append(f"| `{b['policy_id']}` | {b['admitted_gpu_hours_before']:g} → {b['admitted_gpu_hours_after']:g} | {b['admitted_gpu_hours_change']:+g} | {cost} | {b['exhausted_at'] or ''} |")
open(summary, "w").write("\n".join(lines) + "\n")
PY

cat "$SUMMARY"
if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then
  cat "$SUMMARY" >> "$GITHUB_STEP_SUMMARY"
fi
if [ "${BUDGETGATE_FAIL_ON_FLIPS:-0}" = "1" ]; then
  python3 -c 'import json, sys; sys.exit(1 if json.load(open(sys.argv[1]))["flips"] else 0)' "$WORK/what-if.json"
fi
