"""Gradient compression: casts to 16 bits, top-k sparsification and low-rank (PowerSGD), with error feedback.

Pure numpy (:mod:`.compressors`): what is sent for a flat gradient and how the receivers rebuild the sum; the
torch front end (:mod:`paratrain.torch.compressed`) moves the pieces with the collectives or the parameter server.
"""

from paratrain.compression.compressors import (
    COMPRESSIONS,
    Cast,
    Compressor,
    LowRank,
    TopK,
    parse_compression,
)

__all__ = ["COMPRESSIONS", "Cast", "Compressor", "LowRank", "TopK", "parse_compression"]
