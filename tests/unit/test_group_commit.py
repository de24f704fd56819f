"""Group commit (services/admission/batching.py) without servers: a submission that finds no batch
in flight is committed at once; while one is in flight, later submissions wait up to `max_wait`
to be committed together; a batch never exceeds `max_batch`; held-back items go first."""

from __future__ import annotations

import asyncio

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
