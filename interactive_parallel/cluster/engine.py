"""Engine entry point for local pools: an ipyparallel engine that warms up torch meanwhile.

A rank's first real call imports torch and transformers, which takes seconds. Started
in a thread as the engine process starts, that import overlaps the engine's
registration with the controller instead of following it. Knows nothing else; any
ipyparallel engine works as a rank, this one only starts sooner.
"""
if __name__ == "__main__":
    from interactive_parallel.runtime.rank import warm

    warm.start()
    from ipyparallel.engine.app import main

    main()
