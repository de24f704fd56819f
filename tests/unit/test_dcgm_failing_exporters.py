"""A DCGM exporter that fails does not stop the meter (pure, recorded pages): the runs on the
exporters that answered are metered at every scrape; the failing one's runs keep their last
holdings, uncharged for its node until it answers again within max_gap, and dropped (still
uncharged) once its last good page is older than that; the meter's state keeps all this across
a restart, and a state saved by the meter that kept no pages per exporter still loads."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from budgetgate.platforms.dcgm import Holdings, Meter, Usage, holdings

PAGES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"
T0 = datetime(2026, 7, 14, 9, 0, tzinfo=UTC)
FLYTE = "flyte/vision/exec-7f3a/n0"  # 2 GPUs on node A, 2 on node B
TRAIN = "vision-prod/train-resnet-0"  # 4 GPUs on node A
MINUTE = timedelta(minutes=1)


def scrape(**pages: str | None) -> dict[str, Holdings | None]:
    """Exporter → what its recorded page holds; None: the exporter failed."""
    return {exporter: None if name is None else holdings([(PAGES / name).read_text()]) for exporter, name in pages.items()}


def at(meter: Meter, seconds: int, **pages: str | None) -> dict[str, Usage]:
    return {u.run_id: u for u in meter.observe(T0 + timedelta(seconds=seconds), scrape(**pages))}


def seconds(usage: Usage) -> tuple[float, float]:
    return usage.gpu_seconds, usage.node_seconds


def test_a_failing_exporter_stops_only_its_own_nodes_share_which_catches_up_when_it_answers() -> None:
    meter = Meter(max_gap=MINUTE)
    at(meter, 0, a="node-a.prom", b="node-b.prom")
    assert seconds(at(meter, 15, a="node-a.prom", b="node-b.prom")[FLYTE]) == (60.0, 30.0)
    for t in (30, 45):
        failing = at(meter, t, a=None, b="node-b.prom")
        # The run on both nodes goes on by node B's share (2 GPUs, 1 node); node A's waits for its exporter.
        assert seconds(failing[FLYTE]) == (60.0 + 2 * (t - 15), 30.0 + (t - 15))
        # The run on node A alone does not look ended: still held, reported, charged nothing more.
        assert seconds(failing[TRAIN]) == (60.0, 15.0) and len(meter.last[TRAIN].gpus) == 4
        assert len(meter.last[FLYTE].gpus) == 4 and meter.last[FLYTE].hosts == {"gpu-node-a", "gpu-node-b"}
    back = at(meter, 60, a="node-a.prom", b="node-b.prom")
    # Node A's 45 s are counted when its exporter answers: what every exporter answering would have given.
    assert seconds(back[FLYTE]) == (4 * 60.0, 2 * 60.0) and seconds(back[TRAIN]) == (4 * 60.0, 60.0)


def test_a_run_that_ended_while_its_exporter_failed_is_charged_by_the_trapezoid_rule_once_it_answers() -> None:
    meter = Meter(max_gap=MINUTE)
    at(meter, 0, a="node-a.prom", b="node-b.prom")
    at(meter, 15, a=None, b="node-b.prom")
    assert seconds(at(meter, 30, a=None, b="node-b.prom")[TRAIN]) == (0.0, 0.0)
    ended = at(meter, 45, a="node-a-train-ended.prom", b="node-b.prom")
    assert seconds(ended[TRAIN]) == (45 * 4 / 2, 45 / 2)  # held at one end of node A's 45 s: half, as for any interval
    assert TRAIN not in meter.last and TRAIN not in at(meter, 60, a="node-a-train-ended.prom", b="node-b.prom")


def test_past_max_gap_a_failing_exporters_holdings_are_dropped_and_never_charged() -> None:
    meter = Meter(max_gap=MINUTE)
    at(meter, 0, a="node-a.prom", b="node-b.prom")
    at(meter, 15, a="node-a.prom", b="node-b.prom")
    for t in (30, 45, 60, 75):  # node A's last good page (15 s) is at most max_gap old
        assert seconds(at(meter, t, a=None, b="node-b.prom")[TRAIN]) == (60.0, 15.0) and TRAIN in meter.last
    dropped = at(meter, 90, a=None, b="node-b.prom")
    # 75 s since node A's last page: that interval can never be counted, so its holdings are gone,
    # charged nothing; the run is reported once more, as a run that ended.
    assert seconds(dropped[TRAIN]) == (60.0, 15.0) and TRAIN not in meter.last
    assert meter.last[FLYTE].hosts == {"gpu-node-b"} and seconds(dropped[FLYTE]) == (60.0 + 2 * 75, 30.0 + 75)
    assert TRAIN not in at(meter, 105, a=None, b="node-b.prom")
    # Node A answering again starts afresh: its 105 silent seconds are not counted, later intervals are.
    assert seconds(at(meter, 120, a="node-a.prom", b="node-b.prom")[TRAIN]) == (60.0, 15.0)
    back = at(meter, 135, a="node-a.prom", b="node-b.prom")
    assert seconds(back[TRAIN]) == (60.0 + 4 * 15, 15.0 + 15) and seconds(back[FLYTE]) == (60.0 + 2 * 105 + 4 * 15, 30.0 + 105 + 2 * 15)


def test_a_scrape_in_which_every_exporter_failed_changes_nothing() -> None:
    meter = Meter(max_gap=MINUTE)
    at(meter, 0, a="node-a.prom", b="node-b.prom")
    state = meter.state()
    assert at(meter, 15, a=None, b=None) == {} and meter.state() == state
    assert seconds(at(meter, 30, a="node-a.prom", b="node-b.prom")[FLYTE]) == (4 * 30.0, 2 * 30.0)  # a gap within max_gap, as before


def test_state_round_trips_a_failing_exporter_through_a_restart() -> None:
    def steps(meter: Meter, times: range) -> dict[str, Usage]:
        last: dict[str, Usage] = {}
        for t in times:
            last = at(meter, t, a=None if 15 <= t < 60 else "node-a.prom", b="node-b.prom")
        return last

    straight = Meter(max_gap=MINUTE)
    expected = steps(straight, range(0, 76, 15))
    before = Meter(max_gap=MINUTE)
    steps(before, range(0, 31, 15))  # stopped while node A's exporter fails
    restarted = Meter.restored(json.loads(json.dumps(before.state())), max_gap=MINUTE)
    assert restarted.pages.keys() == {"a", "b"} and restarted.pages["a"].at == T0 and restarted.last == before.last
    assert steps(restarted, range(45, 76, 15)) == expected and restarted.state() == straight.state()
    assert seconds(expected[TRAIN]) == (4 * 75.0, 75.0)


def test_a_state_saved_without_pages_per_exporter_still_loads() -> None:
    meter = Meter(max_gap=MINUTE)
    at(meter, 0, a="node-a.prom", b="node-b.prom")
    at(meter, 15, a="node-a.prom", b="node-b.prom")
    # What the meter saved before it kept a page per exporter: the scrape of every exporter as one.
    old = {key: value for key, value in meter.state().items() if key != "pages"}
    every = Meter.restored(json.loads(json.dumps(old)), max_gap=MINUTE)
    # Every exporter answering: counted from the saved scrape, as that meter counted it.
    assert at(every, 30, a="node-a.prom", b="node-b.prom") == at(meter, 30, a="node-a.prom", b="node-b.prom")
    assert every.state() == meter.state()
    # One failing: the saved scrape cannot be split by exporter, so that interval charges nobody;
    # its runs stay held until it is max_gap old, and each exporter is counted from its own page on.
    partial = Meter.restored(json.loads(json.dumps(old)), max_gap=MINUTE)
    first = at(partial, 30, a=None, b="node-b.prom")
    assert seconds(first[FLYTE]) == (60.0, 30.0) and seconds(first[TRAIN]) == (60.0, 15.0) and TRAIN in partial.last
    assert seconds(at(partial, 45, a=None, b="node-b.prom")[FLYTE]) == (60.0 + 2 * 15, 30.0 + 15)
    partial = Meter.restored(json.loads(json.dumps(partial.state())), max_gap=MINUTE)  # and through another restart
    assert TRAIN in at(partial, 75, a=None, b="node-b.prom") and TRAIN in partial.last  # the saved scrape is max_gap old
    assert seconds(at(partial, 90, a=None, b="node-b.prom")[TRAIN]) == (60.0, 15.0) and TRAIN not in partial.last
    assert seconds(at(partial, 105, a="node-a.prom", b="node-b.prom")[TRAIN]) == (60.0, 15.0)  # node A starts afresh
