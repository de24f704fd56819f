"""Group commit (services/admission/batching.py) without servers: a submission that finds no batch
in flight is committed at once, and so is one that arrives alone while a batch is in flight;
while one is in flight, submissions arriving close together wait up to `max_wait` to be
committed together; a batch never exceeds `max_batch`; held-back items go first."""

from __future__ import annotations

import asyncio

import pytest

from budgetgate.services.admission.batching import GroupCommit
from tests.support.waiting import wait_for


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = asyncio.Event()
        self.hold = False

    async def commit(self, batch: list[str]) -> None:
        self.batches.append(batch)
        if self.hold:
            await self.release.wait()


async def test_a_submission_with_no_batch_in_flight_is_committed_at_once() -> None:
    recorder = Recorder()
    commits = GroupCommit(recorder.commit, max_batch=64, max_wait=60.0, in_flight=2)

    commits.submit("a")
    # Were it to wait `max_wait` for company, this would time out.
    await wait_for(lambda: recorder.batches, timeout=5, what="the first batch committed")

    assert recorder.batches == [["a"]]


async def test_while_a_batch_is_in_flight_later_submissions_wait_to_be_committed_together() -> None:
    recorder = Recorder()
    recorder.hold = True
    commits = GroupCommit(recorder.commit, max_batch=64, max_wait=0.3, in_flight=2)

    commits.submit("a")
    await wait_for(lambda: recorder.batches == [["a"]], timeout=5, what='"a" in flight, held')
    commits.submit("b")
    await asyncio.sleep(0.05)  # the scenario: time passes, less than max_wait, while the second batch gathers
    commits.submit("c")
    await wait_for(lambda: len(recorder.batches) >= 2, timeout=5, what="the second batch committed")
    recorder.release.set()

    assert recorder.batches == [["a"], ["b", "c"]]


async def test_batches_are_at_most_max_batch_and_held_back_items_go_first() -> None:
    recorder = Recorder()
    commits = GroupCommit(recorder.commit, max_batch=2, max_wait=0.0, in_flight=1)

    for item in "abcde":
        commits.submit(item)
    commits.resubmit(["x", "y"])
    await wait_for(lambda: sum(map(len, recorder.batches)) >= 7, timeout=5, what="every item committed")

    assert recorder.batches == [["x", "y"], ["a", "b"], ["c", "d"], ["e"]]
    assert (commits.batches, commits.items) == (4, 7)


async def test_a_submission_made_as_the_last_batch_is_answered_is_never_stranded() -> None:
    """The answer of a batch wakes its submitter before the committer's task is done; a
    submission made then must still get a committer, whatever `in_flight` is."""
    for in_flight in (1, 2):
        loop = asyncio.get_running_loop()
        answers: dict[str, asyncio.Future[None]] = {}

        async def commit(batch: list[str]) -> None:
            for item in batch:
                answers[item].set_result(None)

        commits = GroupCommit(commit, max_batch=64, max_wait=0.001, in_flight=in_flight)
        answers["a"] = loop.create_future()
        commits.submit("a")
        await answers["a"]
        answers["b"] = loop.create_future()
        commits.submit("b")  # the committer that answered "a" has found its queue empty by now

        async with asyncio.timeout(5):
            await answers["b"]


class Clock:
    """When submissions arrive, as the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_submission_that_arrives_alone_is_committed_at_once_beside_a_batch_in_flight() -> None:
    """At 200 submissions/s they arrive 5 ms apart: with a batch in flight, the next one must
    not wait `max_wait` for company that is not coming."""
    recorder, clock = Recorder(), Clock()
    recorder.hold = True
    commits = GroupCommit(recorder.commit, max_batch=64, max_wait=60.0, in_flight=2, clock=clock)

    commits.submit("a")
    await wait_for(lambda: recorder.batches == [["a"]], timeout=5, what='"a" in flight, held')
    clock.now = 100.0  # further apart than max_wait
    commits.submit("b")
    # Were it to wait `max_wait` for company, this would time out.
    await wait_for(lambda: len(recorder.batches) == 2, timeout=5, what='"b" committed beside "a"')
    recorder.release.set()

    assert recorder.batches == [["a"], ["b"]]
    assert not commits.company_coming


async def test_submissions_arriving_close_together_are_expected_to_keep_coming() -> None:
    clock = Clock()
    commits = GroupCommit(Recorder().commit, max_batch=64, max_wait=0.001, in_flight=2, clock=clock)
    assert not commits.company_coming  # none arrived yet

    for i in range(4):
        clock.now = i * 0.0002  # 5,000 a second
        commits.submit(str(i))
    assert commits.company_coming and commits.gap == pytest.approx(0.0002)
    clock.now += 0.002  # one longer gap does not undo a run of short ones...
    commits.submit("late")
    assert commits.gap == pytest.approx(0.0002 + 0.25 * (0.002 - 0.0002)) and commits.company_coming
    for _ in range(3):  # ...gaps of 5 ms do
        clock.now += 0.005
        commits.submit("slow")
    assert not commits.company_coming
