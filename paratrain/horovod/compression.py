"""Horovod's gradient compression for allreduce: ``Compression.none`` and ``Compression.fp16`` (floating tensors
travel as float16 and come back in their own dtype; others pass unchanged)."""

from __future__ import annotations

import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """``compress`` returns the tensor to send and what ``decompress`` needs to undo it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype | None) -> torch.Tensor:
        return tensor


class NoneCompressor(Compressor):
    """Sends the tensor as it is."""


class FP16Compressor(Compressor):
    """Floating tensors as float16 on the wire (half the bytes of float32), cast back after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        if tensor.is_floating_point():
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype | None) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class Compression:
    """The choices, as Horovod names them."""

    none = NoneCompressor
    fp16 = FP16Compressor
