"""``python -m paratrain.runtime.serve``: a parameter-server process (``paratrain launch --servers S`` starts these).

It joins the job like any rank and runs the server loop until every worker has left; ``paratrain.init()``
does exactly that for a process whose role is ``server``.
"""

from __future__ import annotations

from paratrain._exit import exit_with
from paratrain.runtime.context import init


def main() -> None:
    """Joins the job as a server; ``init`` serves and exits the process when the workers are done."""
    init()
    raise SystemExit("paratrain.runtime.serve: this process is not a server (PARATRAIN_ROLE is not 'server')")


if __name__ == "__main__":
    exit_with(main)
