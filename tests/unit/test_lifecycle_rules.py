"""The lifecycle rules both ways in share (budgetgate/contracts/lifecycle_rules.py): the reconciler dead-letters
with the first broken rule's words, the HTTP feed names every broken field."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.contracts import lifecycle_rules as lifecycle
from budgetgate.services.reconciler.facts import _lifecycle_problem
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent, LifecycleType


def event(**fields: object) -> LifecycleEvent:
    found = LifecycleEvent(event_id="e1", run_id="r1", type=LifecycleType.STARTED, event_time=Timestamp(seconds=1_800_000_000))
    for name, value in fields.items():
        if name == "event_time":
            found.ClearField("event_time")
        else:
            setattr(found, name, value)
    return found


def test_a_good_event_breaks_no_rule() -> None:
    assert lifecycle.problems(event()) == [] and _lifecycle_problem(event()) is None


def test_every_broken_rule_is_named_and_the_consumer_gives_the_first() -> None:
    bad = event(run_id="", type=0, event_time=None, gpus=-1, nodes=-2)
    assert [field for field, _ in lifecycle.problems(bad)] == ["run_id", "type", "event_time", "gpus", "nodes"]
    assert _lifecycle_problem(bad) == "run_id must be 1 to 256 printable ASCII characters without spaces"
    assert _lifecycle_problem(event(type=0)) == "lifecycle event e1 has no known type (0)"
    assert _lifecycle_problem(event(event_time=None)) == "lifecycle event e1 has no event_time"
    assert _lifecycle_problem(event(nodes=-1)) == "lifecycle event e1 reports nodes outside 0 to 100000"


def test_times_ids_and_resources_no_run_can_have_are_refused() -> None:
    # Each of these passed the rules and then broke the consumer (a time ToDatetime cannot
    # convert), Postgres (NUL in text) or the ledger's figures (2**31 GPUs).
    assert lifecycle.problems(event(event_time=None)) == [("event_time", "lifecycle event e1 has no event_time")]
    for seconds, nanos in ((2**40, 0), (0, 0), (-62_135_596_800, 0), (1_800_000_000, -5), (946_684_799, 999_999_999)):
        found = event()
        found.event_time.seconds, found.event_time.nanos = seconds, nanos
        assert [field for field, _ in lifecycle.problems(found)] == ["event_time"], (seconds, nanos)
    earliest = event()
    earliest.event_time.seconds = 946_684_800  # 2000-01-01T00:00:00Z
    assert lifecycle.problems(earliest) == []
    assert [field for field, _ in lifecycle.problems(event(run_id="a\x00b"))] == ["run_id"]
    assert [field for field, _ in lifecycle.problems(event(run_id="a b"))] == ["run_id"]
    assert [field for field, _ in lifecycle.problems(event(gpus=2**31 - 1))] == ["gpus"]
    assert lifecycle.problems(event(gpus=1_000_000, nodes=100_000)) == []


def test_derived_event_ids_are_stable_and_distinct() -> None:
    assert lifecycle.derived_event_id(event()) == lifecycle.derived_event_id(event())
    assert lifecycle.derived_event_id(event()) != lifecycle.derived_event_id(event(type=LifecycleType.COMPLETED))
    assert lifecycle.event_id_problem("x" * 257) and lifecycle.event_id_problem("a\x00b") and lifecycle.event_id_problem("ok") is None


def test_text_holding_a_control_character_is_a_problem_of_its_field() -> None:
    # The reconciler stores flavor and reason; Postgres text cannot hold a NUL.
    assert [field for field, _ in lifecycle.problems(event(reason="oom\x00"))] == ["reason"]
    assert [field for field, _ in lifecycle.problems(event(flavor="h100\x1b", region="eu\x00"))] == ["flavor", "region"]
    assert "U+0000" in lifecycle.problems(event(reason="\x00"))[0][1]
    assert lifecycle.problems(event(reason="evicted:\tpreempted\nby a higher priority")) == []
