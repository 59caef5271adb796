"""The problems of the scheduling applications, built alike on every rank from a name and a seed: Lasso's design
and response, matrix factorisation's ratings, PageRank's graph."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from paratrain.sched.graph import Graph

__all__ = ["lasso_problem", "mf_problem", "pagerank_graph"]


def lasso_problem(data: str, rows: int, *, seed: int = 0, data_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(X, y) of a Lasso benchmark: a real design whose features are strongly correlated (Fashion-MNIST's 784
    pixels of the first ``rows`` training images, in [0, 1]), or ``"synthetic"``: 784 features in groups of 8
    sharing a latent factor (correlation 0.9 inside a group). y = X b + noise with b sparse (40 nonzeros),
    seeded: the truth is known, the design is the hard part. ``"correlated:NxP"``: N rows, P features in groups of
    10 sharing a latent factor (correlation 0.9), P/100 true coefficients of scale 3, noise 0.5: a wide sparse
    problem on which random blocks still converge."""
    from paratrain.errors import ConfigError

    rng = np.random.default_rng(seed)
    if data == "fashion-mnist":
        from paratrain.train.data import load_dataset

        images = load_dataset("fashion-mnist", data_dir=data_dir).x_train[:rows]
        x = images.reshape(len(images), -1).astype(np.float64)
    elif data == "synthetic":
        latent = rng.normal(size=(rows, 98))
        x = np.sqrt(0.9) * np.repeat(latent, 8, axis=1) + np.sqrt(0.1) * rng.normal(size=(rows, 784))
    elif data.startswith("correlated:"):
        shape = data.split(":", 1)[1].split("x")
        if len(shape) != 2 or not all(d.isdigit() and int(d) >= 10 for d in shape):
            raise ConfigError(
                f"--data correlated:NxP takes two numbers >= 10 (e.g. correlated:1000x5000), got {data!r}"
            )
        n, p = int(shape[0]), int(shape[1]) // 10 * 10
        latent = rng.normal(size=(n, p // 10))
        x = np.sqrt(0.9) * np.repeat(latent, 10, axis=1) + np.sqrt(0.1) * rng.normal(size=(n, p))
        truth = np.zeros(p)
        truth[rng.choice(p, p // 100, replace=False)] = 3 * rng.normal(size=p // 100)
        return x, x @ truth + 0.5 * rng.normal(size=n)
    else:
        raise ConfigError(f"--data must be fashion-mnist, synthetic or correlated:NxP, got {data!r}")
    truth = np.zeros(x.shape[1])
    truth[rng.choice(x.shape[1], 40, replace=False)] = rng.normal(size=40)
    return x, x @ truth + 0.1 * rng.normal(size=len(x))


def mf_problem(
    data: str, rows: int, *, seed: int = 0, data_dir: str | None = None
) -> tuple[sp.csr_matrix, sp.csr_matrix | None]:
    """(train, test) of a factorisation benchmark: ``fashion-mnist`` (the first ``rows`` training images as a
    dense rows x 784 matrix, pixels in [0, 1]; no test part: the optimum is the shrunk SVD's) or
    ``power-law:MxN`` (:func:`~paratrain.sched.mf.power_law_ratings`: M x N, power-law row and column counts,
    a planted rank-8 model with noise 0.1, 10 % of the entries held out)."""
    from paratrain.errors import ConfigError
    from paratrain.sched.mf import observed, power_law_ratings

    if data == "fashion-mnist":
        from paratrain.train.data import load_dataset

        images = load_dataset("fashion-mnist", data_dir=data_dir).x_train[:rows]
        return observed(images.reshape(len(images), -1)), None  # every pixel, zeros included, is an entry
    shape = data.split(":", 1)[1].split("x") if data.startswith("power-law:") else []
    if len(shape) != 2 or not all(d.isdigit() and int(d) > 0 for d in shape):
        raise ConfigError(f"--data must be fashion-mnist or power-law:MxN (e.g. power-law:20000x2000), got {data!r}")
    return power_law_ratings(int(shape[0]), int(shape[1]), seed=seed)


def pagerank_graph(name: str) -> Graph:
    """``debian`` (this machine's installed packages) or ``power-law:N`` (N vertices, edges to later vertices)."""
    from paratrain.errors import ConfigError
    from paratrain.sched.graph import debian_dependencies, power_law_graph

    if name == "debian":
        return debian_dependencies()
    if name.startswith("power-law:") and name.split(":", 1)[1].isdigit():
        n = int(name.split(":", 1)[1])
        edges = power_law_graph(n, 3, seed=0).edges()
        return Graph.from_edges(n, edges[edges[:, 0] < edges[:, 1]])
    raise ConfigError(f"--graph must be debian or power-law:N, got {name!r}")
