"""interactive_parallel: parallel training and inference of transformer models you can see and steer.

Top-level names are light: importing the package imports no torch (the Session starts
ranks that import it); `Session` is loaded on first use, and `panel()` loads ipywidgets
and plotly only when called.
"""
from .plan import Plan, PlanError
from .records import (CommRecord, DecodeStep, MemoryRecord, PipelineEvent, QuantizeRecord, RankInfo, Request,
                      RequestRecord, ServeResult, ShardRecord, StepRecord, TokenRecord, VerifyReport)

__version__ = "0.1.0"
__all__ = ["Session", "Plan", "PlanError", "RankError", "RankTimeout", "SessionError", "panel", "StepRecord",
           "MemoryRecord", "CommRecord", "ShardRecord", "PipelineEvent", "RankInfo", "TokenRecord", "VerifyReport",
           "Request", "RequestRecord", "ServeResult", "DecodeStep", "QuantizeRecord"]


def panel(session=None):
    """The JupyterLab control panel for `session` (None: its Cluster section starts one).
    Every control calls a public method of Session."""
    from .widgets import panel as _panel

    return _panel(session)


def __getattr__(name):
    if name in ("Session", "RankError", "RankTimeout", "SessionError"):
        from . import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'interactive_parallel' has no attribute {name!r}")
