"""Moved: the plan to ``specdec.distributed.shard``, the checkpoint slices to
``specdec.model.shard``; re-exported here so that older imports keep working."""

from specdec.distributed.shard import ShardPlan, plan_shard, shard_arch, vocab_range
from specdec.model.shard import shard_checkpoint

__all__ = ["ShardPlan", "plan_shard", "shard_arch", "shard_checkpoint", "vocab_range"]
