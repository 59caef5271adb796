"""Synchronisation strategies as units: one torch-free parser and registry (:mod:`paratrain.strategy.spec`),
every rule across a strategy's options (:mod:`paratrain.strategy.checks`), the wrappers that decorate a base
strategy (:mod:`paratrain.strategy.wrappers`) and the built-in kinds and wrappers (:mod:`paratrain.strategy.builtin`),
each registered with its update rule, checks and builder."""

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
from paratrain.strategy.wrappers import WrapperUnit, register_wrapper, wrapper_units, wrappers_given

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
    "WrapperUnit",
    "check_options",
    "complete",
    "kinds",
    "parse_layer_schemes",
    "parse_strategy",
    "register_kind",
    "register_wrapper",
    "resolve",
    "servers_of",
    "strategies_help",
    "wrapper_units",
    "wrappers_given",
]
