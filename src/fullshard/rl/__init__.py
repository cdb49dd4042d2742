"""fullshard.rl: what RL post-training needs between training steps.

- :func:`publish`: every weight as a full tensor under its Hugging Face checkpoint name, one
  packed gather per bucket of whole units, cast to the wire dtype before it is sent, the next
  gather in flight while one is consumed, memory bounded by ``bucket_bytes``.
- :func:`shard_rows`: each rank's own rows of every weight, with no communication.
- :class:`ShardDeltas`: each rank's XOR masks of what changed since the last publication, which
  a receiver applies bit for bit.
- :class:`WeightReceiver`: an inference rank's weights in its own layout (full, or a row
  split), updated in place from full tensors, rows or deltas.
- :func:`send_full` / :func:`send_rows` / :func:`send_deltas` and :func:`receive`: those moved
  over ``torch.distributed`` point-to-point messages between training and inference ranks, as
  tensors on the backend's device (:func:`wire_device`: CUDA under NCCL, the CPU under gloo).
- :func:`publish_colocated` and :func:`receive_colocated` (``fullshard.rl.colocated``): the
  full weights handed to an engine process on the same host as whole per-dtype buckets, one
  IPC handle each (CUDA IPC on GPUs, shared memory on the CPU), viewed there without a copy.
- :func:`sleep` / :func:`wake` / :func:`asleep` (``fullshard.rl.sleep``): parameters, gradients,
  optimizer state and buffers to host memory and back, bit for bit, in the same tensors;
- :func:`gathered_for_rollout` (``fullshard.rl.rollout``): a ``generate()`` loop gathers each
  unit once for the whole rollout.

``import fullshard.rl`` (the package's top level does not import it).
"""

from __future__ import annotations

from .colocated import (
    BucketEntry,
    BucketMessage,
    DistLink,
    Link,
    ReceivedBucket,
    colocated_buckets,
    publish_colocated,
    receive_colocated,
)
from .delta import DeltaRows, ShardDeltas, decode_xor, encode_xor
from .names import checkpoint_name, named_weights
from .receiver import WeightReceiver
from .rollout import gathered_for_rollout
from .sleep import SleepReport, asleep, is_asleep, sleep, wake
from .weights import DEFAULT_BUCKET_BYTES, ShardRows, publish, shard_rows
from .wire import (
    Receivers,
    SyncReport,
    backend_device,
    receive,
    send_deltas,
    send_full,
    send_rows,
    wire_device,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BucketEntry",
    "BucketMessage",
    "DeltaRows",
    "DistLink",
    "Link",
    "ReceivedBucket",
    "Receivers",
    "ShardDeltas",
    "ShardRows",
    "SleepReport",
    "SyncReport",
    "WeightReceiver",
    "asleep",
    "backend_device",
    "checkpoint_name",
    "colocated_buckets",
    "decode_xor",
    "encode_xor",
    "gathered_for_rollout",
    "is_asleep",
    "named_weights",
    "publish",
    "publish_colocated",
    "receive",
    "receive_colocated",
    "send_deltas",
    "send_full",
    "send_rows",
    "shard_rows",
    "sleep",
    "wake",
    "wire_device",
]
