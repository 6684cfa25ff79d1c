"""interactive_parallel: parallel training and inference of transformer models you can see and steer.

Top-level names are light: importing the package imports no torch (the Session starts
ranks that import it); `Session` is loaded on first use.
"""
from .plan import Plan, PlanError
from .records import CommRecord, MemoryRecord, PipelineEvent, RankInfo, ShardRecord, StepRecord

__version__ = "0.1.0"
__all__ = ["Session", "Plan", "PlanError", "RankError", "StepRecord", "MemoryRecord", "CommRecord", "ShardRecord",
           "PipelineEvent", "RankInfo"]


def __getattr__(name):
    if name in ("Session", "RankError", "RankTimeout"):
        from . import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'interactive_parallel' has no attribute {name!r}")
