"""Decentralised training (D-PSGD): communication graphs and their doubly-stochastic mixing matrices."""
