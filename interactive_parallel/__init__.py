"""interactive_parallel: parallel training and inference of transformer models you can see and steer.

Top-level names are light: importing the package imports no torch (the Session starts
ranks that import it); `Session` is loaded on first use, `panel()` loads ipywidgets and
plotly only when called, and `dry_run()` loads torch only when called.
"""
from .plan import Plan, PlanError
from .records import (CommRecord, DecodeStep, MemoryRecord, PipelineEvent, QuantizeRecord, RankInfo, Request,
                      RequestRecord, ServeResult, ShardRecord, StepRecord, TokenRecord, VerifyReport)

__version__ = "0.1.0"
__all__ = ["Session", "LocalSession", "Plan", "PlanError", "RankError", "RankTimeout", "SessionError", "panel", "dry_run", "StepRecord",
           "MemoryRecord", "CommRecord", "ShardRecord", "PipelineEvent", "RankInfo", "TokenRecord", "VerifyReport",
           "Request", "RequestRecord", "ServeResult", "DecodeStep", "QuantizeRecord"]


def panel(session=None):
    """The JupyterLab control panel for `session` (None: its Cluster section starts one).
    Every control calls a public method of Session."""
    from .widgets import panel as _panel

    return _panel(session)


def dry_run(model, plan: Plan, world: int | None = None, **kwargs):
    """Lay `model` (a preset, a shipped config such as 'llama-3-70b', a config file or directory)
    out under `plan` over `world` virtual ranks in this process, with the runtime's own code on
    fake tensors and torch's fake process group: no peers, no data, no weights. Returns a DryRun
    holding the records a live session would (memory(), comms(), layout()); see
    interactive_parallel.runtime.client.dryrun. A bad plan or model is refused before torch loads (but for
    a family derived from transformers, whose facts need it)."""
    from .cluster.offline import dry_run as _dry_run  # the client's helper, as the panel's dry run

    return _dry_run(model, plan, world, **kwargs)


def __getattr__(name):
    if name == "LocalSession":  # the one-process mode (cluster/local_session.py): no torch until apply
        from .cluster.local_session import LocalSession

        return LocalSession
    if name in ("Session", "RankError", "RankTimeout", "SessionError"):
        from . import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'interactive_parallel' has no attribute {name!r}")
