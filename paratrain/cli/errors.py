"""How every ``paratrain`` command reports a bad setup: one decorator instead of a handler per command.

A :class:`~paratrain.errors.ConfigError` (a flag, a file or an environment variable that cannot work) is the
user's to fix, so it ends the command with ``paratrain COMMAND: error: WHAT TO DO`` on stderr and exit status 2,
as argparse does for a malformed flag, and no traceback. A :class:`~paratrain.errors.JobFailedError` (a training
job whose processes failed; they said why) ends it with ``paratrain COMMAND: the job failed ...`` and status 1.
Every other exception is a bug or a failure at run time and keeps its traceback.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from paratrain.errors import ConfigError, JobFailedError

__all__ = ["Command", "reports_config_errors"]

#: A command's entry point: its parsed arguments in, its exit status out.
Command = Callable[[argparse.Namespace], int]


def reports_config_errors(name: str) -> Callable[[Command], Command]:
    """Wraps command ``name`` (``"train"``, ``"bench ps"``): a ConfigError becomes its message and exit status 2.

    Example:
        >>> @reports_config_errors("demo")
        ... def run(args):
        ...     raise ConfigError("--nproc must be >= 1")
        >>> import contextlib, io
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     code = run(argparse.Namespace())
        >>> code, err.getvalue()
        (2, 'paratrain demo: error: --nproc must be >= 1\\n')
    """

    def wrap(command: Command) -> Command:
        @functools.wraps(command)
        def run(args: argparse.Namespace) -> int:
            try:
                return command(args)
            except ConfigError as exc:
                print(f"paratrain {name}: error: {exc}", file=sys.stderr)
                return 2
            except JobFailedError as exc:
                print(f"paratrain {name}: {exc}", file=sys.stderr)
                return 1

        return run

    return wrap
