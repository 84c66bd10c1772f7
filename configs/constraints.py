"""Value ranges of config fields, attached to the schema as `typing.Annotated` metadata.

    lr: Annotated[Optional[float], Positive] = None      # None passes, 0 or -1 is an error

The strict loader (loader.py) checks them wherever a value is set (YAML file, `key=value`, a saved
config), so `optim.lr=-1` or `sched.epochs=0` stops before anything runs, with the key named.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Range:
    """low <= value <= high (`<` where open); None bounds are unbounded. None values are not checked."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def violation(self, value) -> Optional[str]:
        """A description of what `value` should be, or None when it is in range."""
        if value is None:
            return None
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        return self.describe() if too_low or too_high else None

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return " and ".join(parts)


Positive = Range(0, low_open=True)
NonNegative = Range(0)
AtLeastOne = Range(1)
Probability = Range(0, 1)  # also fractions in [0, 1]
BelowOne = Range(0, 1, high_open=True)  # rates such as drop_path, label smoothing, EMA decay
