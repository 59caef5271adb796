"""Synchronisation strategies as units: one torch-free parser and registry (:mod:`paratrain.strategy.spec`),
every rule across a strategy's options (:mod:`paratrain.strategy.checks`) and the built-in kinds
(:mod:`paratrain.strategy.builtin`), each registered with its update rule, builder, worker and composer."""

from paratrain.strategy.builtin import PIPELINE_SCHEDULES, STRATEGIES
from paratrain.strategy.checks import check_options, servers_of
from paratrain.strategy.options import CompressionTraits, StrategyOptions
from paratrain.strategy.spec import (
    FAMILIES,
    Family,
    StrategySpec,
    StrategyUnit,
    UnknownStrategyError,
    complete,
    kinds,
    parse_layer_schemes,
    parse_strategy,
    register_kind,
    resolve,
    strategies_help,
)

__all__ = [
    "FAMILIES",
    "PIPELINE_SCHEDULES",
    "STRATEGIES",
    "CompressionTraits",
    "Family",
    "StrategyOptions",
    "StrategySpec",
    "StrategyUnit",
    "UnknownStrategyError",
    "check_options",
    "complete",
    "kinds",
    "parse_layer_schemes",
    "parse_strategy",
    "register_kind",
    "resolve",
    "servers_of",
    "strategies_help",
]
