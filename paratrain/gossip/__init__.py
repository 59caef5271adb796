"""Decentralised training (D-PSGD): communication graphs, their mixing matrices, and the neighbour exchange."""
