"""Hardware profiles as data: the machines a step-time prediction can be asked about.

Owns the shipped profiles (this kind of 2-core CPU machine, and nodes of eight A100, H100 or
H200 GPUs), each figure with its source beside it, the lookup by name, and the check that a
profile (shipped, calibrated or written by hand) holds every figure the step-time model
reads. A calibrated profile (Session.calibrate, fitted by plan.calibration) replaces the
guesses for the machine the ranks run on. Pure data: knows no torch and nothing of models.
"""
from __future__ import annotations

import math

from ..records import HardwareProfile, Link

GB = 1e9
TERA = 1e12

# A100 SXM4 80 GB. Dense peaks from NVIDIA's A100 datasheet (its tensor figures halved: they are
# printed with sparsity): 312 TFLOPS bf16/fp16, 156 tf32, 19.5 fp32; 80 GB HBM2e at 2,039 GB/s;
# NVLink 3, 300 GB/s per direction. DGX A100: 8 GPUs, one 200 Gb/s HDR NIC each (25 GB/s).
# Achievable: the best bf16 GEMM 271 TFLOPS (87 %: ml-engineering's maximum achievable matmul
# table); nccl-tests all_reduce bus bandwidth ~230 GB/s in one DGX A100, ~44 us for 32 KiB
# (ml-engineering's network notes); across nodes ~22 GB/s per NIC (HDR's 25 GB/s line rate less
# protocol overhead); element-wise kernels ~80 % of HBM bandwidth.
A100 = HardwareProfile(
    name="a100", flops={"bf16": 271 * TERA, "fp16": 271 * TERA, "fp32": 0.87 * 156 * TERA},
    peak_flops={"bf16": 312 * TERA, "fp16": 312 * TERA, "fp32": 156 * TERA},
    memory_bytes=80 * 10**9, memory_bandwidth=0.8 * 2039 * GB, devices_per_host=8,
    links=[Link("intra", 30e-6, 230 * GB), Link("inter", 30e-6, 22 * GB)],
    op_overhead_s=5e-6, overlap=1.0,
    source="NVIDIA A100 SXM datasheet (dense); ml-engineering GEMM and nccl-tests tables; fp32 runs as tf32")

# H100 SXM5 80 GB. Dense peaks (NVIDIA H100 datasheet, tensor figures halved): 989 TFLOPS bf16/fp16,
# 495 tf32, 67 fp32; 80 GB HBM3 at 3.35 TB/s; NVLink 4, 450 GB/s per direction. DGX H100 and the
# Llama 3 cluster: 8 GPUs a host, one 400 Gb/s NIC per GPU (NDR InfiniBand or RoCE). Achievable:
# the best bf16 GEMM 794.5 TFLOPS (80 %: ml-engineering's table); all_reduce bus bandwidth ~480 GB/s
# with NVLink SHARP, ~370 GB/s for the other collectives and ring all_reduce (NVIDIA in
# nccl-tests issues 212 and 290); 46-48 GB/s per NDR NIC across nodes (issue 290); ~40 us for a
# 32 KiB all_reduce through torch.distributed (ml-engineering, H200); multi-hop latency "up to
# tens of microseconds" (Llama 3 paper, 3.3.3).
H100 = HardwareProfile(
    name="h100", flops={"bf16": 794.5 * TERA, "fp16": 794.5 * TERA, "fp32": 0.8 * 495 * TERA},
    peak_flops={"bf16": 989 * TERA, "fp16": 989 * TERA, "fp32": 495 * TERA},
    memory_bytes=80 * 10**9, memory_bandwidth=0.8 * 3350 * GB, devices_per_host=8,
    links=[Link("intra", 30e-6, 370 * GB), Link("intra", 30e-6, 480 * GB, op="all_reduce"),
           Link("inter", 30e-6, 46 * GB)],
    op_overhead_s=5e-6, overlap=1.0,
    source="NVIDIA H100 SXM datasheet (dense); ml-engineering GEMM table; nccl-tests issues 212, 290; fp32 runs as tf32")

# H200 SXM 141 GB: the H100's GH100 compute and NVLink 4 (the same dense peaks: 1,979 bf16 is the
# sparse figure), 141 GB HBM3e at 4.8 TB/s (NVIDIA H200 datasheet); 400 Gb/s CX-7 NICs per GPU.
H200 = HardwareProfile(
    name="h200", flops=dict(H100.flops), peak_flops=dict(H100.peak_flops),
    memory_bytes=141 * 10**9, memory_bandwidth=0.8 * 4800 * GB, devices_per_host=8,
    links=list(H100.links), op_overhead_s=5e-6, overlap=1.0,
    source="NVIDIA H200 datasheet (H100 compute, 141 GB HBM3e at 4.8 TB/s); links as H100")

# This kind of machine: 2 cores, 4 ranks sharing them (one thread each), gloo over loopback. A
# device is a rank's share of the machine. Rough figures of its kind (calibrate() measures the
# real ones: run it before trusting a CPU prediction): fp32 matmuls at the tiny presets' shapes,
# four at once; eager dispatch per operation with four processes on two cores; gloo collectives
# of four ranks, a compute burst before each as in a step (bench/bench_steptime.py prints them);
# a message to a pipeline neighbour already waiting for it (0.25-0.5 ms), torch's 1F1B schedule's
# own cost per action (0.5-1.1 ms) and the Linux scheduler's handing of an idle rank's core to a
# busy one (about 3 ms), as calibrate() measured them on such machines.
CPU = HardwareProfile(
    name="cpu", flops={"fp32": 25e9, "bf16": 8e9, "fp16": 4e9}, peak_flops={"fp32": 25e9, "bf16": 25e9, "fp16": 25e9},
    memory_bytes=2 * 2**30, memory_bandwidth=2 * GB, devices_per_host=4, cores_per_host=2,
    links=[Link("intra", 3e-3, 0.8 * GB), Link("inter", 5e-3, 0.1 * GB), Link("intra", 0.4e-3, 2.5 * GB, op="recv", size=2)],
    op_overhead_s=30e-6, matmul_overhead_s=30e-6, overlap=0.0, device="cpu", pipeline_action_s=0.8e-3,
    core_handoff_s=3e-3,
    source="2-core CPU machine, 4 ranks sharing the cores (gloo); rough: calibrate() for this machine's figures")

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (CPU, A100, H100, H200)}
"""Shipped profiles by name."""

PRECISION_KEYS = ("fp32", "bf16", "fp16")


def profile_problems(p: HardwareProfile) -> list[str]:
    """Every missing or impossible figure of `p`, each named; empty when the model can use it."""
    problems = []
    for field in ("flops", "peak_flops"):
        rates = getattr(p, field) or {}
        missing = [k for k in PRECISION_KEYS if k not in rates]
        if missing:
            problems.append(f"profile {p.name!r}: {field} has no rate for {', '.join(missing)}")
        bad = [f"{k}={v}" for k, v in rates.items() if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v))]
        if bad:
            problems.append(f"profile {p.name!r}: {field} must be positive FLOP/s, got {', '.join(bad)}")
    for field in ("memory_bytes", "memory_bandwidth", "devices_per_host"):
        v = getattr(p, field)
        if not (isinstance(v, (int, float)) and v > 0):
            problems.append(f"profile {p.name!r}: {field} must be positive, got {v!r}")
    classes = {x.link for x in p.links}
    if "intra" not in classes:
        problems.append(f"profile {p.name!r}: links has no 'intra' entry (ranks on one host)")
    for x in p.links:
        if not (x.latency_s >= 0 and x.bandwidth > 0):
            problems.append(f"profile {p.name!r}: link {x.link}/{x.op}/{x.size} needs latency_s >= 0 and "
                            f"bandwidth > 0, got {x.latency_s}, {x.bandwidth}")
    if not 0 <= p.overlap <= 1:
        problems.append(f"profile {p.name!r}: overlap must be within [0, 1], got {p.overlap}")
    return problems


def get_profile(profile: str | HardwareProfile | dict) -> HardwareProfile:
    """A profile by name (PROFILES), as a record, or as its dict; refused, naming every missing figure."""
    if isinstance(profile, str):
        if profile.lower() not in PROFILES:
            raise ValueError(f"unknown hardware profile {profile!r}: choose one of {', '.join(PROFILES)} "
                             "or pass a HardwareProfile (Session.calibrate() returns one)")
        return PROFILES[profile.lower()]
    if isinstance(profile, dict):
        missing = [f for f in ("name", "flops", "peak_flops", "memory_bytes", "memory_bandwidth", "devices_per_host")
                   if f not in profile]
        if missing:
            raise ValueError(f"hardware profile {profile.get('name', '?')!r} lacks {', '.join(missing)}")
        profile = HardwareProfile.from_dict(profile)
    problems = profile_problems(profile)
    if problems:
        raise ValueError("hardware profile cannot be used:\n  - " + "\n  - ".join(problems))
    return profile
