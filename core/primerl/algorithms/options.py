"""Option fields for the algorithm components: each loss, correction and estimator is an
attrs class whose fields are its options, checked by these validators when it is built.

Why a module of their own: the config check builds every component before a run starts
(a bad option is one line naming the key), so the validators are what turns a typo into
that line; losses and corrections share them, and a plugin's component may use them too.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["below_one", "non_negative", "normalization", "option", "optional_float", "positive"]


def non_negative(_inst: Any, attr: attrs.Attribute, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


def positive(_inst: Any, attr: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attr.name} must be > 0, got {value}")


def below_one(_inst: Any, attr: attrs.Attribute, value: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"{attr.name} must be in [0, 1) (the ratio's lower bound is 1 - {attr.name}), got {value}")


# a loss's ``normalize`` option: how its per-token terms are summed (primerl.algorithms.losses.reduce)
normalization = attrs.validators.in_(("token", "sequence", "constant"))
optional_float = attrs.converters.optional(float)


def option(default: float, *validators: Any) -> Any:
    """A float option with its default and validators."""
    return attrs.field(default=default, converter=float, validator=list(validators))
