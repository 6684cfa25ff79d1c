"""Engine side: runs inside an ipyparallel engine or a plain torchrun process (never needs ipyparallel).

Importing it filters three known, harmless log lines out of every rank's output (logging
filters only: no library is imported here): torchao's "Failed to load ...so" for its CUDA
extensions on a CPU build (transformers imports torchao whenever it is installed), torch's
pytree note that torchao registers Enum classes, and transformers' continuous-batching
warning that it does not know whether SuppressTokensLogitsProcessor works there (it does:
it masks fixed vocabulary ids; runtime.serve_transformers uses it for the padding rows).
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
