"""Weight-update bridge: trainer shards -> full tensors -> engine names -> buckets -> engines, verified."""
from megaflow.bridge.base import SyncError, SyncReport, WeightBridge, WeightTarget, WeightUpdateResult
from megaflow.bridge.buckets import Bucket, iter_buckets, pack
from megaflow.checksum import tensor_digest

__all__ = ["Bucket", "SyncError", "SyncReport", "WeightBridge", "WeightTarget", "WeightUpdateResult", "iter_buckets",
           "pack", "tensor_digest"]
