"""Gradient compression: casts to 16 bits, top-k sparsification and low-rank (PowerSGD), with error feedback.

Pure numpy (:mod:`.compressors`): what is sent for a flat gradient and how the receivers rebuild the sum, behind one
interface (:class:`Compressor`); the torch front end (:mod:`paratrain.torch.compressed`) moves the messages with the
collectives or the parameter server.
"""

from paratrain.compression import compressors
from paratrain.compression.compressors import *  # noqa: F403 (the package's names are its module's)

__all__ = compressors.__all__
