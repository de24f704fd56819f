"""Fixed-point arithmetic: GPU-hours, showback cost, and the conversions at the edges."""

from __future__ import annotations

from decimal import Decimal

import pytest

from budgetgate.core.units import (
    MICROS_PER_UNIT,
    MILLI_PER_HOUR,
    Unit,
    cost_micros,
    display,
    from_amount,
    hours,
    hours_amount,
    money,
    to_amount,
    to_decimal,
)

H100_RATE = Decimal("3.933")


def test_gpu_hours_is_gpu_count_times_runtime_hours() -> None:
    # The design's worked example: 8 GPUs for 6 hours is 48 GPU-hours.
    amount = hours_amount(8, Decimal(6))
    assert amount == 172_800_000
    assert amount == 48 * MILLI_PER_HOUR
    assert from_amount(Unit.GPU_HOURS, amount) == Decimal(48)
    assert hours(amount) == 48.0


def test_one_gpu_hour_is_three_million_six_hundred_thousand_units() -> None:
    assert Unit.GPU_HOURS.scale == 3_600_000
    assert Unit.NODE_HOURS.scale == 3_600_000
    assert Unit.WALL_HOURS.scale == 3_600_000
    assert Unit.COST.scale == 1_000_000
    assert hours_amount(1, "1") == 3_600_000


@pytest.mark.parametrize(
    ("count", "runtime", "expected"),
    [
        (8, "6", 172_800_000),
        (8, 6.0, 172_800_000),
        (8, 6, 172_800_000),
        (1, "0.5", 1_800_000),
        (3, "0.1", 1_080_000),  # 0.1 as a float must not drift to 0.1000000000000000055
        (3, 0.1, 1_080_000),
        (2, "1.25", 9_000_000),
        (0, "10", 0),
        (5, "0", 0),
        (1, "0.000001", 4),  # 3.6 milli-GPU-seconds rounds half up to 4
    ],
)
def test_hours_amount_examples(count: int, runtime: object, expected: int) -> None:
    assert hours_amount(count, runtime) == expected  # type: ignore[arg-type]


def test_node_hours_use_the_same_formula() -> None:
    # node_hours = node_count × runtime_hours: 4 nodes × 2.5 h = 10 node-hours.
    assert hours_amount(4, "2.5") == to_amount(Unit.NODE_HOURS, 10)


def test_showback_cost_of_the_design_example() -> None:
    # 48 GPU-hours at $3.933 per H100 GPU-hour = $188.784, shown as $188.78.
    micros = cost_micros(hours_amount(8, "6"), H100_RATE)
    assert micros == 188_784_000
    assert money(micros) == Decimal("188.78")
    assert display(Unit.COST, micros) == 188.78


def test_cost_micros_is_exact_not_float() -> None:
    # 1 milli-GPU-second at $3.933/h is 1.0925 micro-dollars; at $1.80/h exactly half a micro.
    assert cost_micros(1, H100_RATE) == 1
    assert cost_micros(1, Decimal("1.8")) == 1  # half up
    assert cost_micros(1, Decimal("1.7999")) == 0
    # 1 GPU-hour at $0.0000005 is half a micro: rounds half up to 1.
    assert cost_micros(MILLI_PER_HOUR, Decimal("0.0000005")) == 1
    assert cost_micros(MILLI_PER_HOUR, Decimal("0.0000004")) == 0
    # 0.1 + 0.2 style drift would make this 300_000.00000000006.
    assert cost_micros(hours_amount(1, "0.1"), Decimal("3")) == 300_000
    assert cost_micros(0, H100_RATE) == 0
    assert cost_micros(hours_amount(1000, "720"), H100_RATE) == 2_831_760_000_000


@pytest.mark.parametrize(
    ("micros", "expected"),
    [
        (188_784_000, "188.78"),
        (188_785_000, "188.79"),  # half up, not half even
        (188_775_000, "188.78"),  # half even would give 188.78 too; both agree here
        (188_765_000, "188.77"),  # half even would give 188.76
        (188_784_999, "188.78"),
        (5_000, "0.01"),
        (4_999, "0.00"),
        (0, "0.00"),
        (5_000_000_000, "5000.00"),
    ],
)
def test_money_rounds_half_up_to_cents(micros: int, expected: str) -> None:
    assert money(micros) == Decimal(expected)
    assert str(money(micros)) == expected


@pytest.mark.parametrize(
    ("unit", "value", "amount"),
    [
        (Unit.GPU_HOURS, "500", 1_800_000_000),
        (Unit.GPU_HOURS, "0.5", 1_800_000),
        (Unit.GPU_HOURS, "1.00001", 3_600_036),
        (Unit.NODE_HOURS, "400", 1_440_000_000),
        (Unit.WALL_HOURS, "24", 86_400_000),
        (Unit.COST, "5000", 5_000_000_000),
        (Unit.COST, "188.78", 188_780_000),
        (Unit.COST, "0.000001", 1),
        (Unit.COST, "3.933", 3_933_000),
    ],
)
def test_fixed_point_round_trips(unit: Unit, value: str, amount: int) -> None:
    assert to_amount(unit, value) == amount
    assert from_amount(unit, amount) == Decimal(value)
    assert to_amount(unit, from_amount(unit, amount)) == amount


def test_to_amount_accepts_decimal_int_float_and_string_alike() -> None:
    expected = to_amount(Unit.GPU_HOURS, Decimal("2.5"))
    assert to_amount(Unit.GPU_HOURS, 2.5) == expected
    assert to_amount(Unit.GPU_HOURS, "2.5") == expected
    assert to_amount(Unit.GPU_HOURS, 5) == 2 * expected


def test_to_amount_rounds_sub_unit_values_half_up() -> None:
    # Below the fixed unit the value is rounded once, half up.
    assert to_amount(Unit.COST, "0.0000005") == 1
    assert to_amount(Unit.COST, "0.0000004999") == 0
    assert to_amount(Unit.COST, "-0.0000005") == -1  # half up is away from zero in Decimal


def test_float_goes_through_its_shortest_repr() -> None:
    assert to_decimal(0.1) == Decimal("0.1")
    assert to_decimal(3.933) == Decimal("3.933")
    assert to_decimal(1e-7) == Decimal("1E-7")


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), float("-inf"), "NaN", "nan", "sNaN", "Infinity", "-Infinity", "inf", Decimal("NaN"), Decimal("Infinity")],
)
def test_nan_and_infinity_are_rejected(value: object) -> None:
    with pytest.raises(ValueError, match="not a finite number"):
        to_decimal(value)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        to_amount(Unit.GPU_HOURS, value)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        hours_amount(8, value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["", "six", "1,5", "1.2.3", "1e", None, object()])
def test_junk_is_rejected_with_value_error(value: object) -> None:
    with pytest.raises(ValueError, match="not a number"):
        to_decimal(value)  # type: ignore[arg-type]


def test_display_shows_hours_as_float_and_cost_in_cents() -> None:
    assert display(Unit.GPU_HOURS, 172_800_000) == 48.0
    assert display(Unit.NODE_HOURS, 1_800_000) == 0.5
    assert display(Unit.COST, 188_784_000) == 188.78
    assert display(Unit.COST, 188_785_000) == 188.79
    assert isinstance(display(Unit.GPU_HOURS, 1), float)


def test_micros_per_unit_matches_cost_scale() -> None:
    assert to_amount(Unit.COST, 1) == MICROS_PER_UNIT


def test_projected_amounts_round_up_never_down_to_nothing() -> None:
    from budgetgate.core.units import projected_cost_micros, projected_hours_amount

    # 1 GPU × 1e-9 h is 0.0036 milli-GPU-seconds: half-up makes it 0, a projection makes it 1.
    assert hours_amount(1, "1e-9") == 0
    assert projected_hours_amount(1, "1e-9") == 1
    assert projected_hours_amount(8, "6") == hours_amount(8, "6") == 172_800_000  # exact stays exact
    assert projected_hours_amount(0, "6") == 0  # CPU-only work on GPU-hours
    assert projected_cost_micros(1, H100_RATE) == 2 and cost_micros(1, H100_RATE) == 1
