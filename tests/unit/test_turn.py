"""A pipelined batch's Turn (budgetgate.messaging.inbox.Turn) without servers: once finished it lets go
of the batch before it, so a long-running consumer does not keep every turn since its start
(each with its poll's event ids) alive through the chain."""

from __future__ import annotations

import gc
import weakref

from budgetgate.messaging.inbox import Turn


def test_a_finished_turn_lets_go_of_the_one_before_it() -> None:
    first = Turn(event_ids=frozenset({"e1"}))
    gone = weakref.ref(first)
    second = Turn(after=first)
    third = Turn(after=second)
    del first

    first_finished = gone()
    assert first_finished is not None and first_finished.event_ids == {"e1"}  # the batch after it still reads it
    del first_finished
    second.finish()  # applied: it waits on nothing before it any more
    gc.collect()

    assert gone() is None
    assert third.after is second  # a turn not finished keeps its own link
    assert second.claimed.is_set() and second.handled.is_set()
