"""Shards of the Redis ledger (budgetgate.core.shards): their tags, a root's shard, and the
numbering that keeps two shards' ledger sequences apart."""

from __future__ import annotations

import zlib
from collections import Counter
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budgetgate.core.escrow import lease_key
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.contracts.admission import AdmissionRequest
from budgetgate.core.shards import shared, MAX_SHARDS, SEQ_STEP, RootConflict, Shards, key_root, organisations
from budgetgate.decisions.concurrency import NoSensitiveTenant, asks
from budgetgate.ledger.roots import Move, moves
from budgetgate.ledger.holds import LEASED, counter_args, lease_root, sensitive_lease
from tests.support.accounts import account_budget, account_tree
from tests.support.admission import budget_yaml, submission
from tests.support.quotas import POOLS


def test_one_shard_is_the_ledger_as_it_always_was() -> None:
    one = Shards("bg")
    assert (one.tag(0), one.step, one.of_root("any-org")) == ("{bg}", 1, 0)
    assert one.start(0, 0) == 0 and one.start(0, 1_234) == 1_234  # any number: a single shard's


def test_several_shards_have_a_tag_each() -> None:
    shards = Shards("bg", 3)
    assert [shards.tag(i) for i in range(3)] == ["{bg:0}", "{bg:1}", "{bg:2}"]
    assert shards.step == SEQ_STEP
    with pytest.raises(ValueError, match="shard 3 of a ledger of 3"):
        shards.tag(3)
    for count in (0, MAX_SHARDS + 1):
        with pytest.raises(ValueError, match=f"1 to {MAX_SHARDS} shards"):
            Shards("bg", count)


def test_a_roots_shard_is_the_same_in_every_process() -> None:
    # CRC-32, not hash() (salted per process): every replica and every restart must place a root
    # on the same shard, or a decision would look for its keys where they are not.
    shards = Shards("bg", 8)
    assert shards.of_root("org-a") == zlib.crc32(b"org-a") % 8 == 2  # pinned: a change would move every root


def test_roots_spread_over_the_shards() -> None:
    shards = Shards("bg", 8)
    placed = Counter(shards.of_root(f"org-{i}") for i in range(8_000))
    assert set(placed) == set(range(8))
    assert all(850 <= n <= 1_150 for n in placed.values()), placed


def test_a_rebuilt_shard_restarts_at_its_own_residue() -> None:
    shards = Shards("bg", 4)
    assert [shards.start(i, 0) for i in range(4)] == [0, 1, 2, 3]
    assert shards.start(2, 2 + 5 * SEQ_STEP) == 2 + 5 * SEQ_STEP
    with pytest.raises(ValueError, match="not shard 2's"):
        shards.start(2, 3 + 5 * SEQ_STEP)  # another shard's number: Postgres was asked the wrong residue


@given(count=st.integers(2, MAX_SHARDS), data=st.data())
def test_the_numbers_of_two_shards_never_meet(count: int, data: st.DataObject) -> None:
    """Any shards, each rebuilt from any committed number of its own and advanced any number of
    times, hand out distinct numbers, each of its own residue and above what it restarted at."""
    shards = Shards("bg", count)
    chosen = data.draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=6, unique=True))
    handed: dict[int, int] = {}
    for shard in chosen:
        committed = data.draw(st.sampled_from([0, shard + SEQ_STEP * data.draw(st.integers(0, 10**6))]))
        seq = shards.start(shard, committed)
        for _ in range(data.draw(st.integers(1, 20))):
            seq += shards.step  # what every script's INCRBY does
            assert seq % SEQ_STEP == shard and seq > committed
            assert seq not in handed, f"shards {handed[seq]} and {shard} both handed out {seq}"
            handed[seq] = shard


def test_a_keys_root_is_the_tenant_its_budget_names_or_its_leases_root() -> None:
    window = "2026-11-01T00:00:00Z/2026-12-01T00:00:00Z"
    assert key_root(f"ns=ml;cost-center=7;team=vision|{window}|gpu_hours", "team") == "vision"
    assert key_root(f"ns=ml;team=vision|{window}|gpu_hours", "squad") == ""  # names no tenant (by that label)
    assert key_root(f"ns=ml|{window}|gpu_hours", "team") == ""
    assert key_root(lease_key(f"cost-center=7|{window}|gpu_hours", "nlp"), "team") == "nlp"


def _bundle(text: str):  # type: ignore[no-untyped-def]
    return build_bundle(parse_text(text, "policies.yaml"), git_sha="a" * 40)


def test_budgets_tenants_share_are_those_whose_scope_names_no_single_tenant() -> None:
    pinned = budget_yaml("vision", namespace="ml", labels="{team: vision}")
    by_namespace = budget_yaml("by-namespace", namespace="ml", labels="{}")  # charged through each tenant's escrow lease
    any_team = budget_yaml("any-team", namespace="ml", labels='{team: "*"}')
    rolling = budget_yaml("rolling", namespace="ml", labels="{}", window="{rolling_days: 7}")  # through leases too
    assert all(shared(_bundle(p).policies[0], "team") for p in (by_namespace, any_team, rolling))
    assert not shared(_bundle(pinned).policies[0], "team")
    for window in ("{calendar: month}", "{rolling_days: 7}"):
        attached = _bundle(account_tree() + account_budget("research", "research", 100, window=window))
        assert shared(attached.policies[0], "team")  # charged through each tenant's lease


def test_on_several_shards_a_sensitive_run_counts_on_its_tenants_lease_and_a_runs_pool_token_is_taken_apart() -> None:
    sensitive = "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: sensitive}\nspec: {sensitive_pool_size: 16}\n"
    bundle = _bundle("\n---\n".join([budget_yaml("vision", namespace="ml", labels="{team: vision}"), sensitive, POOLS.format(child=1, parent=5, cap=5)]))
    now = datetime.now(UTC)

    def request(**extra: object) -> AdmissionRequest:
        return AdmissionRequest.model_validate(submission(run_id="r", namespace="ml", resources={"gpus": 4, "nodes": 1}, job=None, **extra))

    one = asks(bundle, request(labels={"team": "vision", "sensitive": "true"}), tenant_label="team", now=now)
    assert [(c.name, c.lease) for c in one.counters] == [("t:vision", False), ("sensitive", False)]
    leased = asks(bundle, request(labels={"team": "vision", "sensitive": "true"}), tenant_label="team", now=now, leased=True)
    assert [(c.name, c.lease, c.limits) for c in leased.counters][1] == ("sensitive@vision", True, (16, None, None))
    assert counter_args(leased.counters)[-3:] == [LEASED, -1, -1]  # reserve.lua reads the lease's size
    with pytest.raises(NoSensitiveTenant, match="must name its tenant"):
        asks(bundle, request(labels={"sensitive": "true"}), tenant_label="team", now=now, leased=True)
    token = {"namespace": "snowflake:wh-1"}
    one_shard = asks(bundle, request(labels={"team": "vision"}, pool_token=token), tenant_label="team", now=now)
    assert one_shard.pool is not None and not one_shard.pool_apart
    apart = asks(bundle, request(labels={"team": "vision"}, pool_token=token), tenant_label="team", now=now, leased=True)
    assert apart.pool == one_shard.pool and apart.pool_apart  # the same token, taken on the pools' shard
    assert not asks(bundle, request(labels={"team": "vision"}), tenant_label="team", now=now, leased=True).pool_apart
    assert sensitive_lease("vision") == "sensitive@vision" and lease_root("sensitive@vision") == "vision" and lease_root("t:vision") is None


def _orgs(*branches: tuple[str, str, str]) -> str:
    """Account documents: (organisation, team account, tenant) each, the team under its organisation."""
    docs = [f"apiVersion: budgetgate/v1\nkind: Account\nmetadata: {{id: {org}}}\nspec: {{level: organisation}}\n" for org in sorted({b[0] for b in branches})]
    docs += [
        f"apiVersion: budgetgate/v1\nkind: Account\nmetadata: {{id: {team}}}\nspec: {{level: team, parent: {org}, scope: {{labels: {{team: {tenant}}}}}}}\n"
        for org, team, tenant in branches
    ]
    return "\n---\n".join(docs)


def test_the_account_trees_organisations_are_the_roots_of_the_tenants_it_names() -> None:
    # vision and nlp sit under acme's research department, alice (a user) under vision: her scope
    # carries vision's team label, so names the same tenant; nlp is scoped by namespace alone and
    # names none (its runs' tenants stay their own roots).
    assert organisations(_bundle(account_tree()).accounts, "team") == {"vision": "acme"}
    assert organisations(_bundle(account_tree()).accounts, "squad") == {}  # the tree names no tenant by that label
    two = _bundle(_orgs(("acme", "acme-vision", "vision"), ("globex", "globex-nlp", "nlp"), ("globex", "globex-speech", "speech")))
    assert organisations(two.accounts, "team") == {"vision": "acme", "nlp": "globex", "speech": "globex"}


def test_a_tenant_under_two_organisations_is_refused_with_both_named() -> None:
    torn = _bundle(_orgs(("acme", "acme-vision", "vision"), ("globex", "globex-vision", "vision")).replace("team: vision}}}", "team: vision, site: a}}}", 1))
    with pytest.raises(RootConflict, match="team=vision under acme and globex"):
        organisations(torn.accounts, "team")


@given(tenants=st.lists(st.text("abcdefgh-", min_size=1, max_size=6), min_size=1, max_size=30, unique=True), data=st.data())
def test_a_pinned_tenant_lives_on_its_organisations_shard_and_any_other_on_its_own(tenants: list[str], data: st.DataObject) -> None:
    orgs = data.draw(st.lists(st.sampled_from(["acme", "globex", "initech"]), min_size=len(tenants), max_size=len(tenants)))
    pinned = {t: o for t, o, keep in zip(tenants, orgs, data.draw(st.lists(st.booleans(), min_size=len(tenants), max_size=len(tenants))), strict=True) if keep}
    count = data.draw(st.integers(1, MAX_SHARDS))
    shards, unpinned = Shards("bg", count, pinned), Shards("bg", count)
    for tenant in tenants:
        assert shards.of_root(tenant) == (unpinned.of_root(pinned[tenant]) if tenant in pinned else unpinned.of_root(tenant))
    assert shards.of_root("") == unpinned.of_root("")  # what no tenant owns stays where it was
    # A ledger key is placed by its tenant, so a pinned tenant's budgets and leases go with it.
    window = "2026-11-01T00:00:00Z/2026-12-01T00:00:00Z"
    for tenant in pinned:
        for key in (f"ns=ml;team={tenant}|{window}|gpu_hours", lease_key(f"ns=ml|{window}|gpu_hours", tenant)):
            assert shards.of_root(key_root(key, "team")) == unpinned.of_root(pinned[tenant])


def test_moves_name_every_tenant_a_new_placement_changes() -> None:
    current = {"vision": "acme", "nlp": "acme", "speech": "globex"}
    wanted = {"vision": "acme", "nlp": "globex", "ads": "globex"}
    assert moves(current, wanted) == [Move("ads", "ads", "globex"), Move("nlp", "acme", "globex"), Move("speech", "globex", "speech")]
    shards = Shards("bg", 3, current)
    assert shards != Shards("bg", 3, wanted) and shards == Shards("bg", 3, dict(current))  # a placement is its roots too
    assert hash(shards) == hash(Shards("bg", 3, wanted))  # (hashable: the roots are left out of the hash)
    assert Move("speech", "globex", "speech").describe(shards, Shards("bg", 3, wanted)) == (
        f"speech: organisation globex -> its own root, shard {shards.of_root('speech')} -> {Shards('bg', 3).of_root('speech')}"
    )
