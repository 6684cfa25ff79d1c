"""Pure functions from records to plotly Figures, and an HTML report of them.

Owns how training, memory, communication (and why each collective happened), expert routing,
pipeline (measured and simulated), sharding, each rank's latest collectives (a hang's mismatch), predicted step times of plans (ranked, and against
the measured steps) and inference (decoding steps, served requests, quantization) records are
drawn. Knows nothing of torch, ipyparallel or ipywidgets: it is testable without a kernel, and
the widgets and the CLI call it with whatever records they hold. Every figure has an empty state
("no data yet: train a step"), and every title is broken into lines that fit a figure of
TITLE_FITS_PX.
"""
from ._common import EMPTY_TEXT, TITLE_CHARS, TITLE_FITS_PX, add_to_title, human_bytes, title_lines, title_with
from .collectives import collective_lanes_figure
from .comm_tree import comm_tree_figure, comm_tree_nodes
from .comms import comm_breakdown, comm_breakdown_figure, comm_matrix, comm_matrix_figure
from .decoding import kv_memory_figure, quantization_figure, step_split_figure, tokens_per_step_figure
from .experts import (expert_load, expert_load_figure, expert_load_over_steps_figure, imbalance, tokens_moved,
                      tokens_moved_figure)
from .memory import memory_figure
from .mesh import MeshGrid, comm_links, mesh_figure, mesh_grid
from .pipeline import bubble_fractions, pipeline_figure
from .plans import plans_figure, predicted_vs_measured_figure, step_times
from .report import figures_from_records, write_report
from .ring import ring_rounds, ring_rounds_figure
from .schedule import schedule_figure
from .serving import latency_figure, request_phases, request_timeline_figure
from .sharding import layout_table, shard_regions, sharding_figure
from .timeline import timeline_figure
from .training import loss_figure, throughput_figure

__all__ = [
    "EMPTY_TEXT", "human_bytes", "TITLE_CHARS", "TITLE_FITS_PX", "title_lines", "title_with", "add_to_title",
    "loss_figure", "throughput_figure", "memory_figure", "comm_matrix", "comm_matrix_figure",
    "comm_breakdown", "comm_breakdown_figure", "comm_tree_figure", "comm_tree_nodes", "timeline_figure", "pipeline_figure", "bubble_fractions",
    "sharding_figure", "layout_table", "shard_regions", "write_report", "figures_from_records",
    "tokens_per_step_figure", "kv_memory_figure", "step_split_figure", "quantization_figure",
    "request_timeline_figure", "latency_figure", "request_phases",
    "MeshGrid", "mesh_grid", "comm_links", "mesh_figure",
    "expert_load", "expert_load_figure", "imbalance", "tokens_moved", "tokens_moved_figure",
    "expert_load_over_steps_figure", "schedule_figure",
    "ring_rounds", "ring_rounds_figure", "collective_lanes_figure",
    "plans_figure", "predicted_vs_measured_figure", "step_times",
]
