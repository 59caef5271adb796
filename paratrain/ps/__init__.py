"""Parameter server: sharded key-value store with BSP/SSP/ASP consistency and server-side optimizers."""

from paratrain.ps.client import KVStore
from paratrain.ps.protocol import PSRequestError

__all__ = ["KVStore", "PSRequestError"]
