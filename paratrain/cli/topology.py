"""``paratrain topology``: a gossip graph's mixing matrix, spectral gap and per-node traffic, before training on it."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parser"]

_SHOW_MATRIX_UP_TO = 16  # wider matrices do not fit a terminal; --json always has the whole matrix


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``topology`` on the ``paratrain`` parser."""
    p = sub.add_parser(
        "topology",
        help="show a gossip graph's mixing matrix, spectral gap and traffic per step",
        description=(
            "Build the Metropolis-Hastings mixing matrix W of a gossip graph over N workers (or check a W you "
            "give in a JSON file with 'mixing_matrix', the format --json writes) and print W, its spectral gap "
            "(1 - second largest |eigenvalue|: the larger, the faster workers agree) and what each worker sends "
            "per gossip step for a model of --bytes bytes."
        ),
    )
    p.add_argument(
        "graph",
        help="ring, torus, exponential, complete, a graph file ('u v' per line or JSON pairs), or a JSON file "
        "with a 'mixing_matrix'",
    )
    p.add_argument(
        "-n", "--workers", type=int, default=None, help="number of workers (default for a file: highest rank + 1)"
    )
    p.add_argument(
        "--bytes", default="1MiB", help="model size for the traffic estimate (default 1MiB; K/M/G, KB/MB/GB)"
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON to FILE ('-': stdout)")
    p.add_argument("--decimals", type=int, default=3, help="decimals of the printed matrix (default 3)")
    p.set_defaults(func=_main)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9}


def _parse_bytes(text: str) -> int:
    from paratrain.errors import ConfigError

    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"bad --bytes {text!r}: use a whole number with an optional unit, e.g. 4096, 512KiB, 1MiB, 10MB"
        )
    return int(match.group(1)) * _UNITS[unit or ""]


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _report(args: argparse.Namespace) -> dict[str, Any]:
    from paratrain.errors import ConfigError
    from paratrain.gossip.mixing import load_mixing, per_node_traffic, resolve_mixing, spectral_gap
    from paratrain.gossip.topology import TOPOLOGIES, load_edges, torus_shape

    nbytes = _parse_bytes(args.bytes)
    name = args.graph.strip().lower()
    n = args.workers
    weights = "Metropolis-Hastings"
    if name not in TOPOLOGIES:
        if not Path(args.graph).is_file():
            raise ConfigError(
                f"{args.graph!r} is neither one of {', '.join(TOPOLOGIES)} nor an existing graph or matrix file"
            )
        given = load_mixing(args.graph)
        if given is not None:
            weights = f"given in {args.graph}"
            n = given.shape[0] if n is None else n
        elif n is None:
            edges = load_edges(args.graph)
            n = max((v for _, v in edges), default=0) + 1
    elif n is None:
        raise ConfigError(f"--workers N is needed for the {name!r} topology")
    if n < 1:
        raise ConfigError(f"--workers must be >= 1, got {n}")
    w, edges = resolve_mixing(name if name in TOPOLOGIES else args.graph, n)
    traffic = per_node_traffic(w, nbytes)
    report: dict[str, Any] = {
        "topology": name if name in TOPOLOGIES else str(args.graph),
        "workers": n,
        "weights": weights,
        "edges": [list(e) for e in edges],
        "spectral_gap": spectral_gap(w),
        "mixing_matrix": w.tolist(),
        "model_bytes": nbytes,
        "traffic_per_step": [
            {"rank": t.rank, "neighbors": t.neighbors, "bytes_sent": t.bytes_sent, "bytes_received": t.bytes_received}
            for t in traffic
        ],
    }
    if name == "torus":
        report["torus_shape"] = list(torus_shape(n))
    return report


def _print(report: dict[str, Any], decimals: int) -> None:
    n = report["workers"]
    shape = f" ({report['torus_shape'][0]} x {report['torus_shape'][1]})" if "torus_shape" in report else ""
    print(f"topology {report['topology']}{shape}, {n} workers, {len(report['edges'])} edges")
    if n <= _SHOW_MATRIX_UP_TO:
        print(f"mixing matrix W ({report['weights']}, rounded to {decimals} decimals):")
        width = decimals + 3
        for row in report["mixing_matrix"]:
            print("  " + " ".join(f"{x:{width}.{decimals}f}" for x in row))
    else:
        print(f"mixing matrix W: {n} x {n}, not printed (use --json FILE)")
    gap = report["spectral_gap"]
    print(f"spectral gap: {gap:.6f}  (distance to consensus shrinks by at least x{1 - gap:.4f} per step)")
    print(f"traffic per gossip step for a {_human(report['model_bytes'])} model:")
    print(f"  {'rank':>4} {'neighbors':>9} {'sent':>12} {'received':>12}")
    for row in report["traffic_per_step"]:
        print(
            f"  {row['rank']:>4} {row['neighbors']:>9} {_human(row['bytes_sent']):>12} "
            f"{_human(row['bytes_received']):>12}"
        )


@reports_config_errors("topology")
def _main(args: argparse.Namespace) -> int:
    from paratrain.errors import ConfigError

    if args.decimals < 0:
        raise ConfigError(f"--decimals must be >= 0, got {args.decimals}")
    report = _report(args)
    if args.json == "-":
        print(json.dumps(report, indent=2))
        return 0
    _print(report, args.decimals)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"paratrain topology: error: cannot write {args.json!r}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 0
