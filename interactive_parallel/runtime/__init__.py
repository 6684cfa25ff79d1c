"""Engine side: runs inside an ipyparallel engine or a plain torchrun process (never needs ipyparallel)."""
