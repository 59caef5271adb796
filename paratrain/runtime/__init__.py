"""The cluster runtime: rendezvous, the per-rank context, and the ``init``/``shutdown`` life cycle."""
