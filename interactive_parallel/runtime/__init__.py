"""Engine side: runs inside an ipyparallel engine or a plain torchrun process (never needs ipyparallel).

Its folders by job, from the lowest floor up; a folder imports only folders on floors below its
own (tests/test_architecture.py holds the table), and each folder's __init__ says what it owns:
- probes/ (what a step did: memory, comms, compute intervals, layout) and model/ (the
  transformers model before any layout): no other folder;
- rank/: what a rank keeps between calls, its channel to the driver, the faults armed on it and
  the boundary a long loop crosses between steps;
- groups/: process groups and meshes;
- parallel/ (one parallelism each) and calibration/ (timings on a bare group);
- layout/: the parallelisms composed under a plan, and the shards they leave;
- training/ and inference/: what runs on a layout;
- checkpoints/ (a layout's state saved, kept, carried to a new plan, exported) and client/ (the
  dry run, the schedule preview and the script export: the client's process, no peers);
- api.py (what a client may ask a rank to do) and loop.py (the long calls) on top.

Importing it filters three known, harmless log lines out of every rank's output (logging
filters only: no library is imported here): torchao's "Failed to load ...so" for its CUDA
extensions on a CPU build (transformers imports torchao whenever it is installed), torch's
pytree note that torchao registers Enum classes, and transformers' continuous-batching
warning that it does not know whether SuppressTokensLogitsProcessor works there (it does:
it masks fixed vocabulary ids; runtime.inference.serve_transformers uses it for the padding rows).
"""
import logging as _logging


class _Drop(_logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: _logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(f in message for f in self.fragments)


for _name, _fragments in (("torchao", ("Failed to load",)),
                          ("torch.utils._pytree", ("is an Enum subclass",)),
                          ("ContinuousBatchingLogger", ("SuppressTokensLogitsProcessor might not be supported",))):
    _logging.getLogger(_name).addFilter(_Drop(*_fragments))
