"""Pure functions from records to plotly Figures, and an HTML report of them.

Owns how training, memory, communication, pipeline and sharding records are drawn. Knows nothing
of torch, ipyparallel or ipywidgets: it is testable without a kernel, and the widgets and the CLI
call it with whatever records they hold. Every figure has an empty state ("no data yet: train a step").
"""
from ._common import EMPTY_TEXT, human_bytes
from .comms import comm_breakdown, comm_breakdown_figure, comm_matrix, comm_matrix_figure
from .memory import memory_figure
from .pipeline import bubble_fractions, pipeline_figure
from .report import figures_from_records, write_report
from .sharding import layout_table, shard_regions, sharding_figure
from .timeline import timeline_figure
from .training import loss_figure, throughput_figure

__all__ = [
    "EMPTY_TEXT", "human_bytes", "loss_figure", "throughput_figure", "memory_figure", "comm_matrix", "comm_matrix_figure",
    "comm_breakdown", "comm_breakdown_figure", "timeline_figure", "pipeline_figure", "bubble_fractions",
    "sharding_figure", "layout_table", "shard_regions", "write_report", "figures_from_records",
]
