"""Properties of decayed usage (core/decay.py), the arithmetic behind decayed fair share: a weight
that halves every half-life, and a running sum of decayed amounts kept as one figure and the
instant it is reckoned at."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budgetgate.core.decay import Decayed, decayed_share, steady_amount, weight

pytestmark = pytest.mark.property

START = datetime(2026, 1, 1, tzinfo=UTC)
half_lives = st.integers(min_value=60, max_value=90 * 86400).map(lambda s: timedelta(seconds=s))
ages = st.integers(min_value=0, max_value=400 * 86400).map(lambda s: timedelta(seconds=s))
amounts = st.integers(min_value=0, max_value=10**12)
offsets = st.integers(min_value=0, max_value=60 * 86400).map(lambda s: START + timedelta(seconds=s))
pieces = st.lists(st.tuples(amounts, offsets), max_size=30)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


@given(a=ages, b=ages, h=half_lives)
def test_weight_never_grows_with_age(a: timedelta, b: timedelta, h: timedelta) -> None:
    young, old = sorted((a, b))
    assert 0.0 <= weight(old, h) <= weight(young, h) <= 1.0


@given(h=half_lives, k=st.integers(min_value=0, max_value=40))
def test_weight_halves_every_half_life(h: timedelta, k: int) -> None:
    assert weight(timedelta(0), h) == 1.0
    assert weight(h, h) == 0.5
    assert close(weight(k * h, h), 2.0**-k)


@given(a=ages, b=ages, h=half_lives)
def test_weights_of_consecutive_ages_multiply(a: timedelta, b: timedelta, h: timedelta) -> None:
    assert math.isclose(weight(a + b, h), weight(a, h) * weight(b, h), rel_tol=1e-9, abs_tol=1e-300)


@given(h=half_lives)
def test_limits_nothing_is_left_after_many_half_lives_and_everything_without_decay(h: timedelta) -> None:
    assert weight(2000 * h, h) == 0.0
    assert weight(h, h * 10**6) > 1 - 1e-6  # a half-life a million times longer: barely any decay


@given(found=pieces, h=half_lives, later=ages)
def test_the_running_figure_is_the_sum_of_each_piece_decayed(found: list[tuple[int, datetime]], h: timedelta, later: timedelta) -> None:
    figure = Decayed.empty(h, START)
    for amount, at in found:
        figure = figure.add(amount, at)
    read_at = max([at for _, at in found], default=START) + later
    exact = sum(amount * weight(read_at - at, h) for amount, at in found)
    assert math.isclose(figure.at(read_at), exact, rel_tol=1e-9, abs_tol=1e-6)


@given(found=pieces, h=half_lives)
def test_the_order_pieces_arrive_in_does_not_matter(found: list[tuple[int, datetime]], h: timedelta) -> None:
    forward, backward = Decayed.empty(h, START), Decayed.empty(h, START)
    for amount, at in found:
        forward = forward.add(amount, at)
    for amount, at in reversed(found):
        backward = backward.add(amount, at)
    read_at = START + timedelta(days=61)
    assert math.isclose(forward.at(read_at), backward.at(read_at), rel_tol=1e-9, abs_tol=1e-6)


@given(parts=st.lists(amounts, min_size=1, max_size=20), at=offsets, h=half_lives, later=ages)
def test_an_amount_in_pieces_at_one_instant_counts_as_the_whole(parts: list[int], at: datetime, h: timedelta, later: timedelta) -> None:
    split = Decayed.empty(h, START)
    for part in parts:
        split = split.add(part, at)
    whole = Decayed.empty(h, START).add(sum(parts), at)
    assert math.isclose(split.at(at + later), whole.at(at + later), rel_tol=1e-9, abs_tol=1e-6)


@given(amount=amounts, at=offsets, h=half_lives, a=ages, b=ages)
def test_a_figure_decays_monotonically_and_by_half_in_a_half_life(amount: int, at: datetime, h: timedelta, a: timedelta, b: timedelta) -> None:
    figure = Decayed.empty(h, START).add(amount, at)
    sooner, later = sorted((a, b))
    assert figure.at(at + later) <= figure.at(at + sooner) <= amount
    assert close(figure.at(at + h), amount / 2)


@given(amount=amounts, at=offsets, h=half_lives, h2=half_lives, later=ages)
def test_a_new_half_life_keeps_the_figure_and_decays_at_the_new_rate(amount: int, at: datetime, h: timedelta, h2: timedelta, later: timedelta) -> None:
    figure = Decayed.empty(h, START).add(amount, at)
    moved = figure.with_half_life(h2, at + later)
    assert moved.half_life == h2 and close(moved.at(at + later), figure.at(at + later))
    assert close(moved.at(at + later + h2), figure.at(at + later) / 2)


@given(gpus=st.integers(min_value=0, max_value=4096), cluster=st.integers(min_value=1, max_value=100_000), h=half_lives)
def test_holding_gpus_steadily_makes_the_decayed_share_the_raw_share(gpus: int, cluster: int, h: timedelta) -> None:
    """A tenant that has held `gpus` for ever has decayed usage steady_amount(gpus, h), and its
    decayed share equals its raw share gpus / cluster; one that has held them for 10 half-lives
    is within 0.1 % of it."""
    assert close(decayed_share(steady_amount(gpus, h), cluster, h), gpus / cluster)
    figure, step = Decayed.empty(h, START), h / 100
    for i in range(1000):
        figure = figure.add(gpus * 3_600_000 * step.total_seconds() / 3600, START + i * step)
    measured = decayed_share(figure.at(START + 1000 * step), cluster, h)
    assert measured <= gpus / cluster * 1.001 + 1e-12
    assert measured >= gpus / cluster * 0.99 - 1e-12


@given(found=pieces, cluster=st.integers(min_value=1, max_value=100_000), h=half_lives, later=ages)
def test_the_decayed_share_is_not_negative_and_falls_without_usage(found: list[tuple[int, datetime]], cluster: int, h: timedelta, later: timedelta) -> None:
    figure = Decayed.empty(h, START)
    for amount, at in found:
        figure = figure.add(amount, at)
    now = START + timedelta(days=61)
    assert 0.0 <= decayed_share(figure.at(now + later), cluster, h) <= decayed_share(figure.at(now), cluster, h)
