"""Tensor fusion as a pure plan: which gradients share a bucket and when a bucket may start (no torch here)."""

from paratrain.fusion.buckets import DEFAULT_BUCKET_BYTES, Bucket, LaunchOrder, ParamInfo, plan_buckets

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "LaunchOrder", "ParamInfo", "plan_buckets"]
