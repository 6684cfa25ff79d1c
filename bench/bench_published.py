"""The step-time model against published runs: Llama 3 405B's layouts (Dubey et al. 2024, Table 4)
and torchtitan's published Llama 3 8B / 70B runs, predicted on the shipped H100 / A100 profiles.

Each row is the published layout as a Plan (the settings its source names: degrees, sequence,
batch, bf16, recomputation, sequence parallel; Megatron's vocabulary-parallel head is our
loss_parallel), the prediction (plan.steptime.predict_step: tokens/s per GPU, MFU, the step's
split) beside the published figure; then the memory of the paper's layout per GPU against an
H100's 80 GB under its own settings and with recomputation, and the search's time for
Llama-3-70B on 1,024 ranks. Pure Python, seconds. docs/planning.md's "Which plan?" tables quote it.
Run: .venv/bin/python bench/bench_published.py
"""
from __future__ import annotations

import time

GIB = 2**30


def runs():
    from interactive_parallel.plan import Plan

    def llama3(gpus, tp, cp, pp, dp, seq, per_dp, mfu, **kw):
        plan = Plan(device="cuda", tp=tp, cp=cp, pp=pp, fsdp=dp, seq_len=seq, batch_size=dp * per_dp,
                    microbatches=per_dp, pp_schedule="interleaved-1f1b", virtual_stages=2, precision="bf16",
                    sequence_parallel=True, loss_parallel=True, **kw)
        return (f"Llama 3 405B, {gpus:,} H100, TP{tp} CP{cp} PP{pp} DP{dp}, seq {seq:,}", "llama-3.1-405b", "h100",
                plan, f"{mfu:.0%} MFU", dict(mfu=mfu))

    def titan(model, gpus, layout, seq, local, tps, profile="h100", **kw):
        plan = Plan(device="cuda", seq_len=seq, batch_size=gpus // kw.get("tp", 1) * local, precision="bf16", **kw)
        return (f"torchtitan {model}, {gpus} {profile.upper()}, {layout}, local batch {local}", f"llama-3-{model.lower()}",
                profile, plan, f"{tps:,} tok/s/GPU", dict(tps=tps))

    return [
        llama3(8192, 8, 1, 16, 64, 8192, 32, 0.43),
        llama3(16384, 8, 1, 16, 128, 8192, 16, 0.41),
        llama3(16384, 8, 16, 16, 8, 131072, 16, 0.38),
        titan("8B", 8, "FSDP 8, selective AC", 8192, 2, 5762, fsdp=8, recompute="selective"),
        titan("8B", 128, "FSDP 128, selective AC", 8192, 2, 5605, fsdp=128, recompute="selective"),
        titan("70B", 256, "FSDP 32 x TP 8, full AC", 8192, 16, 597, fsdp=32, tp=8, recompute="full",
              sequence_parallel=True),
        titan("8B", 64, "FSDP 64, selective AC", 8192, 1, 2904, profile="a100", fsdp=64, recompute="selective"),
        titan("70B", 64, "FSDP 64, full AC", 8192, 1, 331, profile="a100", fsdp=64, recompute="full"),
    ]


def main() -> None:
    from interactive_parallel.plan import resolve_model
    from interactive_parallel.plan.estimate import gathered_bytes, predict_memory, rank_peak
    from interactive_parallel.plan.search import search_plans
    from interactive_parallel.plan.steptime import predict_step, representative_ranks

    print(f"{'run':64s} {'published':>18s} {'predicted':>18s} {'compute s':>9s} {'comm s':>7s} {'bubble s':>8s}")
    for name, model, profile, plan, published, _ in runs():
        p = predict_step(resolve_model(model), plan, profile, memory=False)
        figure = f"{p.mfu:.0%} MFU" if "MFU" in published else f"{p.tokens_per_s / plan.world_size:,.0f} tok/s/GPU"
        print(f"{name:64s} {published:>18s} {figure:>18s} {p.compute_s:9.2f} {p.comm_s:7.2f} {p.bubble_s:8.2f}")
    spec = resolve_model("llama-3.1-405b")
    _, _, _, paper, _, _ = runs()[0]
    print(f"\nLlama 3 405B, the paper's 8,192-GPU layout: peak GiB per GPU (fullest pipeline rank) against 80 GB = "
          f"{80e9 / GIB:.1f} GiB")
    print(f"{'settings':46s} {'params':>7s} {'grads':>7s} {'optim':>7s} {'activ':>8s} {'gathered':>9s} {'total':>8s}")
    for label, plan in (("paper: SP, no recompute, 32 microbatches", paper),
                        ("+ selective recompute", paper.replace(recompute="selective")),
                        ("+ full recompute", paper.replace(recompute="full")),
                        ("+ full recompute, 16 microbatches (x2 accum)", paper.replace(recompute="full", microbatches=16,
                                                                                      grad_accum=2))):
        mem = max(predict_memory(spec, plan, ranks=representative_ranks(plan)), key=lambda m: rank_peak(spec, plan, m))
        print(f"{label:46s} {mem.params / GIB:7.1f} {mem.grads / GIB:7.1f} {mem.optimizer / GIB:7.1f} "
              f"{mem.activations / GIB:8.1f} {gathered_bytes(spec, plan, mem.rank) / GIB:9.1f} "
              f"{rank_peak(spec, plan, mem) / GIB:8.1f}")
    t = time.perf_counter()
    rows = search_plans("llama-3-70b", 1024, "h100", batch_size=512, seq_len=8192, top=5)
    print(f"\nsearch_plans(llama-3-70b, 1024 ranks, h100, batch 512 x 8,192): {time.perf_counter() - t:.1f} s; best:")
    print(rows)


if __name__ == "__main__":
    main()
