"""Synchronisation strategies by name: one torch-free parser and registry (:mod:`paratrain.strategy.spec`)."""

from paratrain.strategy.spec import (
    FAMILIES,
    STRATEGIES,
    Family,
    KindInfo,
    StrategySpec,
    UnknownStrategyError,
    kinds,
    parse_layer_schemes,
    parse_strategy,
    register_kind,
    strategies_help,
)

__all__ = [
    "FAMILIES",
    "STRATEGIES",
    "Family",
    "KindInfo",
    "StrategySpec",
    "UnknownStrategyError",
    "kinds",
    "parse_layer_schemes",
    "parse_strategy",
    "register_kind",
    "strategies_help",
]
