"""What fraction of a GPU a MIG instance is, from the labels dcgm-exporter gives it.

Under MIG, dcgm-exporter reports each GPU instance as its own sample, with the parent GPU's
`UUID` and `modelName`, and `GPU_I_PROFILE` (the instance's profile, e.g. `3g.40gb`) and
`GPU_I_ID`. The rule: an instance of profile `<N>g.<memory>` is N compute slices of the GPU's
total for its model, so it is charged N / total of a GPU:

| model | compute slices |
|---|---|
| A100 (40 and 80 GB, SXM and PCIe), H100 (SXM, PCIe, NVL), H200, H20, GH200, B200, GB200 | 7 |
| A30 | 4 |

Only the compute part `<N>g` counts: the memory part varies by model and driver (an A100 80GB's
full instance has been reported as `7g.79gb`), and suffixes such as `+me` (media extensions) or
`+gfx` change neither. A model or profile outside this table is an error naming it, never a
guess; an operator adds a model with `extra` (model → its compute slices).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

MODEL_SLICES: dict[str, int] = {
    "A100": 7,
    "A30": 4,
    "H100": 7,
    "H200": 7,
    "H20": 7,
    "GH200": 7,
    "B200": 7,
    "GB200": 7,
}
_PROFILE = re.compile(r"^(\d+)g\.\d+gb(\+[a-z]+)*$")


class MigProfileError(ValueError):
    """A MIG instance whose share of its GPU cannot be worked out (the model or profile is unknown)."""


def _words(model: str) -> list[str]:
    # "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA-A100-SXM4-80GB" (--replace-blanks-in-model-name)
    return [w.upper() for w in re.split(r"[\s\-_]+", model) if w]


def compute_slices(model: str, extra: Mapping[str, int] | None = None) -> int:
    """The compute slices a GPU of `model` (dcgm-exporter's `modelName`) has under MIG."""
    table = {**MODEL_SLICES, **{name.upper(): slices for name, slices in (extra or {}).items()}}
    if model.upper() in table:
        return table[model.upper()]
    found = {table[word] for word in _words(model) if word in table}
    if len(found) != 1:
        known = ", ".join(sorted(table))
        raise MigProfileError(f"the GPU model {model!r} has no known number of MIG compute slices (known: {known}); give it with --mig-slices MODEL=N")
    return found.pop()


def instance_share(model: str, profile: str, extra: Mapping[str, int] | None = None) -> float:
    """The fraction of one GPU that a MIG instance of `profile` on a GPU of `model` is."""
    matched = _PROFILE.match(profile.strip())
    if matched is None:
        raise MigProfileError(f"the MIG profile {profile!r} (GPU model {model!r}) is not of the form <N>g.<memory>gb: its share of the GPU is unknown")
    slices, total = int(matched.group(1)), compute_slices(model, extra)
    if not 1 <= slices <= total:
        raise MigProfileError(f"the MIG profile {profile!r} has {slices} compute slices, but a {model!r} has {total}")
    return slices / total
