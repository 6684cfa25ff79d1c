"""The records that cross between ranks and the client: plain dataclasses of numbers and strings.

Ranks build records and ship the objects themselves (ipyparallel pickles them); the client
keeps them, viz/ draws them; dicts (`to_dict`, `from_dict`) are for JSON files and reports.
One module per subject: base (the dict mechanism every record shares, the registry of kinds,
tables), training, comm_tree (a step's collectives grouped by their cause: module, op,
collective), schedule, hardware (a machine profile, calibration samples, a predicted step) (a pipeline schedule as torch simulates it), inference, ranks,
state (a layout's state and the scratch directory), stacks (where each rank is: its threads'
stacks, its groups' latest collectives), lint (what the layout lint found).
Options going to the ranks and answers coming back are records too: nothing else crosses.
Knows nothing of torch, ipyparallel or plotly.
"""
from .base import RECORD_TYPES, Record, RecordList, from_dict, table
from .comm_tree import CommNode, comm_tree
from .hardware import CalibrationSample, HardwareProfile, Link, StepPrediction
from .lint import LintFinding, LintKind, LintSeverity
from .inference import (DecodeStep, GenerateOptions, Generation, QuantizeRecord, Request, RequestRecord,
                        ServeEngine, ServeOptions, ServePolicy, ServeResult, TokenRecord)
from .ranks import (ClockRecord, CommEstimate, FaultKind, FaultPlace, FaultSpec, GroupMember, HostMemory,
                    NetworkFacts, ParamDiff, RankFacts, RankIdentity, RankInfo, RankPlace, VerifyReport)
from .schedule import ScheduleAction, SchedulePreview
from .stacks import CollectiveRecord, FrameRecord, StackRecord
from .state import LayoutInfo, RestoreSource, SaveInfo, ScratchLayout, SnapshotInfo
from .training import (TENSOR_KINDS, CommRecord, DataKind, DataSource, ExpertRecord, MemoryRecord, PipelineEvent,
                       ShardRecord, StepRecord, TensorKind)

__all__ = [
    "RECORD_TYPES", "Record", "RecordList", "from_dict", "table", "ClockRecord", "CommEstimate",
    "CommRecord", "CommNode", "comm_tree", "DecodeStep", "ExpertRecord", "FaultSpec", "Generation", "MemoryRecord", "ParamDiff",
    "PipelineEvent", "QuantizeRecord", "RankInfo", "Request", "RequestRecord", "ServeResult",
    "ShardRecord", "StepRecord", "TokenRecord", "VerifyReport", "GenerateOptions", "ServeEngine", "ServeOptions",
    "ServePolicy", "GroupMember", "HostMemory", "NetworkFacts", "FaultKind", "FaultPlace", "RankFacts",
    "RankIdentity", "RankPlace", "LayoutInfo",
    "RestoreSource", "SaveInfo", "ScratchLayout", "SnapshotInfo", "DataKind", "DataSource",
    "TENSOR_KINDS", "TensorKind", "ScheduleAction", "SchedulePreview", "LintFinding", "LintKind", "LintSeverity", "CalibrationSample", "HardwareProfile", "Link", "StepPrediction",
    "CollectiveRecord", "FrameRecord", "StackRecord",
]
