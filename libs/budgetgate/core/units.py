"""Fixed-point amounts: the ledger never stores a float.

Hour-based units (GPU-hours, node-hours, wall-hours) are held in milli-unit-seconds, so one
GPU-hour is 3,600,000; money is held in micro-units of its currency. Floats appear only at the
edges (JSON in, JSON out), converted through Decimal with one rounding, half up.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, ROUND_HALF_UP, Decimal, InvalidOperation
from enum import StrEnum

MILLI_PER_HOUR = 3_600_000
MICROS_PER_UNIT = 1_000_000
CENT = Decimal("0.01")


class Unit(StrEnum):
    GPU_HOURS = "gpu_hours"
    NODE_HOURS = "node_hours"
    WALL_HOURS = "wall_hours"
    COST = "cost"

    @property
    def scale(self) -> int:
        return MICROS_PER_UNIT if self is Unit.COST else MILLI_PER_HOUR


def to_decimal(value: Decimal | float | int | str) -> Decimal:
    """Exact decimal of a finite number; raises ValueError for NaN, infinities and junk."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite number")
        value = repr(value)  # shortest repr: 0.1 stays 0.1, not 0.1000000000000000055…
    try:
        result = Decimal(value)
    except (InvalidOperation, TypeError) as exc:
        raise ValueError(f"{value!r} is not a number") from exc
    if not result.is_finite():
        raise ValueError(f"{value!r} is not a finite number")
    return result


def _round(value: Decimal, rounding: str = ROUND_HALF_UP) -> int:
    return int(value.quantize(Decimal(1), rounding=rounding))


def to_amount(unit: Unit, value: Decimal | float | int | str) -> int:
    """A human figure in `unit` (hours, or currency) as the ledger's integer amount."""
    return _round(to_decimal(value) * unit.scale)


def limit_amount(unit: Unit, value: Decimal | float | int | str) -> int:
    """A budget's limit as the ledger's integer amount, rounded down: a limit is never more
    generous than written (validation refuses a positive one that rounds to nothing)."""
    return _round(to_decimal(value) * unit.scale, ROUND_FLOOR)


def smallest(unit: Unit) -> str:
    """The ledger's unit of `unit`, in words."""
    return {
        Unit.GPU_HOURS: "a thousandth of a GPU-second",
        Unit.NODE_HOURS: "a thousandth of a node-second",
        Unit.WALL_HOURS: "a thousandth of a second",
        Unit.COST: "a millionth of the currency",
    }[unit]


def from_amount(unit: Unit, amount: int) -> Decimal:
    """The ledger's integer amount as an exact figure in `unit`."""
    return Decimal(amount) / unit.scale


def hours_amount(count: int, runtime_hours: Decimal | float | str, *, rounding: str = ROUND_HALF_UP) -> int:
    """count × runtime_hours in milli-unit-seconds (8 GPUs × 6 h = 48 GPU-hours)."""
    return _round(Decimal(count) * to_decimal(runtime_hours) * MILLI_PER_HOUR, rounding)


def projected_hours_amount(count: int, runtime_hours: Decimal | float | str) -> int:
    """What a run is projected to use, rounded up to the ledger's unit: a run too small to
    show in the unit still reserves one, so it can never slip through an exhausted budget."""
    return hours_amount(count, runtime_hours, rounding=ROUND_CEILING)


def cost_micros(gpu_milli_hours: int, rate_per_gpu_hour: Decimal, *, rounding: str = ROUND_HALF_UP) -> int:
    """Showback cost, in micro-units, of an amount of GPU-hours at a rate per GPU-hour."""
    return _round(Decimal(gpu_milli_hours) * rate_per_gpu_hour * MICROS_PER_UNIT / MILLI_PER_HOUR, rounding)


def projected_cost_micros(gpu_milli_hours: int, rate_per_gpu_hour: Decimal) -> int:
    """The showback cost a run is projected to incur, rounded up like projected hours."""
    return cost_micros(gpu_milli_hours, rate_per_gpu_hour, rounding=ROUND_CEILING)


def money(micros: int) -> Decimal:
    """Micro-units as a currency figure rounded to cents, half up ($188.784 → $188.78)."""
    return (Decimal(micros) / MICROS_PER_UNIT).quantize(CENT, rounding=ROUND_HALF_UP)


def hours(amount: int) -> float:
    """Milli-unit-seconds as float hours, for JSON."""
    return float(Decimal(amount) / MILLI_PER_HOUR)


def display(unit: Unit, amount: int) -> float:
    """An amount as the float a person reads (hours, or currency rounded to cents)."""
    return float(money(amount)) if unit is Unit.COST else hours(amount)
