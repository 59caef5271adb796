"""Shared memory between the ranks of one host: a segment every rank maps, and counters to wait on in it.

Why a package of its own, between the transports and the algorithms: a segment is not a
:class:`~paratrain.transport.base.Transport` (it carries no tagged messages), yet two algorithm packages build
their protocols on it: the collectives (:mod:`paratrain.collectives.shm`) and gossip's neighbour exchange
(:mod:`paratrain.gossip.shm`). It imports only a transport (to hand the segment's name to its members) and
:mod:`paratrain.errors`; the algorithms import it, never the reverse.
"""
