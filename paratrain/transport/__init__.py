"""Transports: point-to-point messages between ranks (``inproc``, ``zmq``, and the fault injector)."""

from paratrain.transport.base import ANY_SOURCE, ANY_TAG, Handle, Transport
from paratrain.transport.wire import Message

__all__ = ["ANY_SOURCE", "ANY_TAG", "Handle", "Message", "Transport"]
