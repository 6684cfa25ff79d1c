"""One parallelism per file, each exposing apply_<x>(model, mesh, ...); composed by runtime.layout.parallelize."""
