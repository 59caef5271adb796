"""What the ``paratrain bench`` commands share: the size option's parser, options built from the flags, and how a
report is printed and saved."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, TypeVar

__all__ = ["options_from", "print_report", "size_list"]

_Options = TypeVar("_Options")


def size_list(text: str) -> list[int]:
    """``--size``-style text (``4KiB,1MiB``) as byte counts, or argparse's error."""
    from paratrain.bench.harness import parse_sizes

    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def options_from(cls: type[_Options], args: argparse.Namespace, **given: Any) -> _Options:
    """A benchmark's options dataclass ``cls`` from the flags named as its fields, and ``given`` for the others.

    A flag left unset (None) keeps the field's default, so the dataclass holds every default in one place.

    Example:
        >>> @dataclasses.dataclass
        ... class Options:
        ...     workers: int = 2
        ...     iters: int | None = 10
        ...     torch: bool = True
        >>> options_from(Options, argparse.Namespace(workers=4, iters=None, json=None), torch=False)
        Options(workers=4, iters=10, torch=False)
    """
    fields = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    found = {name: value for name, value in vars(args).items() if name in fields and value is not None}
    return cls(**{**found, **given})


def print_report(command: str, table: str, found: dict[str, Any], json_path: str | None, code: int) -> int:
    """Prints a benchmark's table, writes its JSON if asked, and returns the exit code (1 if the JSON failed)."""
    print()
    print(table, flush=True)
    if json_path:
        try:
            with open(json_path, "w", encoding="utf-8") as fh:
                json.dump(found, fh, indent=2)
                fh.write("\n")
        except OSError as exc:
            print(f"paratrain bench {command}: error: cannot write {json_path}: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {json_path}")
    return code
