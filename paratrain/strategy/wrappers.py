"""Options that change how a base strategy sends, registered as wrappers of it (:class:`WrapperUnit`).

A kind's builder builds its base strategy; each wrapper the options ask for then decorates that base, in
registration order (``compression=`` replaces what travels, ``reliable=`` when it travels). A wrapper registers,
once, its checks, its torch decorator, what it changes in the base's update rule and whether the base's buckets
must stay in host memory for it. Torch-free, like the kinds' registry."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from paratrain.strategy.options import StrategyOptions
from paratrain.strategy.spec import StrategySpec

__all__ = ["WrapperUnit", "register_wrapper", "wrapper_units", "wrappers_given"]


@dataclass(frozen=True)
class WrapperUnit:
    """A registered wrapper of a base strategy.

    Attributes:
        name: the wrapper, as its option is named (``"compression"``).
        option: the :class:`StrategyOptions` field that asks for it (truthy: asked for).
        update_rule: what it changes in the base's update rule (the one place that says so).
        checks: ``checks(spec, options)`` raises ConfigError when the base ``spec`` or the other options do not go
            with it (each refusal saying what to do).
        decorator: the torch front end's decorator, ``"module:name"``: ``decorator(request, base) -> Built``.
        host_buckets: the decorated base must keep its buckets in host memory (the wrapper reads them there).
    """

    name: str
    option: str
    update_rule: str
    checks: Callable[[StrategySpec, StrategyOptions], None]
    decorator: str
    host_buckets: bool = True

    def given(self, options: StrategyOptions) -> bool:
        """Whether ``options`` ask for this wrapper."""
        return bool(getattr(options, self.option))


_WRAPPERS: dict[str, WrapperUnit] = {}


def register_wrapper(unit: WrapperUnit) -> None:
    """Adds a wrapper (its name new, its option a field of :class:`StrategyOptions`, every part given).

    Raises:
        ValueError: the name is taken, the option unknown, or a part missing.
    """
    if unit.name in _WRAPPERS or unit.option not in StrategyOptions.__dataclass_fields__:
        raise ValueError(f"cannot register wrapper {unit.name!r}: name taken or no option {unit.option!r}")
    if not callable(unit.checks) or not unit.update_rule.strip():
        raise ValueError(f"wrapper {unit.name!r} registers no checks or no update rule")
    if not re.fullmatch(r"[a-z_][\w.]*:[A-Za-z_]\w*", unit.decorator):
        raise ValueError(f"wrapper {unit.name!r} registers no decorator ('package.module:name')")
    _WRAPPERS[unit.name] = unit


def wrapper_units() -> tuple[WrapperUnit, ...]:
    """The registered wrappers, in the order they decorate a base strategy."""
    return tuple(_WRAPPERS.values())


def wrappers_given(options: StrategyOptions) -> tuple[WrapperUnit, ...]:
    """The wrappers ``options`` ask for, in decoration order.

    Example:
        >>> import paratrain.strategy
        >>> [w.name for w in wrappers_given(StrategyOptions(reliable=True))]
        ['reliable']
    """
    return tuple(unit for unit in _WRAPPERS.values() if unit.given(options))
