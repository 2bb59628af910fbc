"""The trainer side of RL with dsv4: weight sync to the rollout engine and rollout-vs-trainer agreement.

    WeightSender            broadcast weights to engines over torch.distributed (gloo / NCCL)
    ColocatedWeightSender   the same metadata, buckets in shared memory (an engine on the same host)
    agreement               verl's rollout-vs-trainer probability metrics plus the k3 KL estimate
"""

from dsv4.rl.colocated import ColocatedWeightSender
from dsv4.rl.metrics import Agreement, agreement
from dsv4.rl.plan import DEFAULT_BUCKET_BYTES, WeightSyncPlan, plan_buckets
from dsv4.rl.sender import WeightSender

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Agreement",
    "ColocatedWeightSender",
    "WeightSender",
    "WeightSyncPlan",
    "agreement",
    "plan_buckets",
]
