"""What every part of the scenario schema shares: bounds on numbers, the strict base model,
device and link names, safe file names and the error of one field."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from slicesched.hardware.specs import DEVICES, LINKS

# Bounds on numbers that would otherwise hang or exhaust memory (the CLI checks its options
# against the same ones). A Gamma gap with CV far above ~20 has a shape so small that most
# draws underflow to 0 and arrival generation stops advancing.
MAX_CV = 20.0
MAX_RATE = 1e5  # requests per second of one stream
MAX_DURATION_S = 7 * 86400.0
MAX_RATE_SCALE = 1e4
MAX_TOKENS = 1 << 20  # token lengths, budgets
MAX_SEQS = 1 << 16  # sequences in one batch
LENDER_KV_KEPT = 0.25  # share of its KV pool a lender always keeps: the replay lends no more

RateScale = Annotated[float, Field(gt=0, le=MAX_RATE_SCALE)]

_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def file_name(name: str) -> str:
    """`name` (read from a file) as a safe file name: runs of other characters than letters,
    digits, '.', '_', '+' and '-' become '_', leading dots go, never empty, at most 100 characters;
    so it can never climb out of the folder it is joined to."""
    safe = _UNSAFE.sub("_", name).lstrip(".")[:100]
    return safe if safe.strip("_") else "unnamed"


class FieldProblem(ValueError):
    """A whole-scenario check that one field is to blame for: reported at that field's line."""

    def __init__(self, loc: tuple, message: str) -> None:
        super().__init__(message)
        self.loc = loc


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _known_device(v: str) -> str:
    if v not in DEVICES:
        raise ValueError(f"unknown device '{v}', expected one of {', '.join(DEVICES)}")
    return v


def _known_link(v: str) -> str:
    if v not in LINKS:
        raise ValueError(f"unknown link '{v}', expected one of {', '.join(LINKS)}")
    return v


DeviceName = Annotated[str, AfterValidator(_known_device)]
LinkName = Annotated[str, AfterValidator(_known_link)]
