"""attrs validators the config sections share: a number that must be positive, or not negative.

Each raises ``ValueError("<field>: ...")``; the config loader reads the field's name from the
message's start and reports the key with where its value came from. A leaf: imports attrs only.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["non_negative", "positive"]


def positive(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name}: must be > 0, got {value}")


def non_negative(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name}: must be >= 0, got {value}")
