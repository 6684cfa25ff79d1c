"""Notebook 10's **Try:** paragraph, at its end (`win` is the search's winner on 80 GB H100s)."""
# %%
from interactive_parallel.plan.search import NoPlanFits

half = search_plans("llama-3-70b", 256, "h100", batch_size=256, seq_len=8192, top=5, memory_per_rank=40 * GiB)
held = search_plans("llama-3-70b", 256, "h100", batch_size=256, seq_len=8192, top=1, memory_per_rank=40 * GiB, tp=8)[0]
h200 = search_plans("llama-3-70b", 256, "h200", batch_size=256, seq_len=8192, top=1)[0]
try:
    search_plans("llama-3-70b", 256, "h100", batch_size=256, seq_len=8192, top=5, memory_per_rank=4 * GiB)
except NoPlanFits as err:
    too_little = err
for label, r in (("80 GB winner", win), ("40 GiB winner", half[0]), ("40 GiB, tp=8", held), ("h200 winner", h200)):
    print(f"{label:14} {r.plan:34} {r.seconds:5.2f} s, {r.memory_bytes / GiB:5.1f} GiB")
print(type(too_little).__name__ + ":", str(too_little).splitlines()[-1].strip(), "| closest:", too_little.closest.plan)
# %%
fields, slower = half[0].plan_fields, (half[0].seconds - win.seconds) / win.seconds
expect(fields["fsdp"] > win.plan_fields["fsdp"] and fields["dp"] < win.plan_fields["dp"]
       and half[0].memory_bytes <= 40 * GiB < win.memory_bytes and 0.005 < slower < 0.025,
       "Try: at 40 GiB the winner trades data parallelism for FSDP: less memory per rank, 1 to 2 % slower",
       seen=f"{half[0].plan}, {slower:.1%} slower")
expect(held.seconds > half[0].seconds, "Try: holding tp=8 costs time", seen=f"{held.seconds:.2f} s")
expect(h200.plan_fields["fsdp"] < win.plan_fields["fsdp"], "Try: on the h200 profile a plan with less FSDP wins",
       seen=h200.plan)
expect(too_little.closest is not None and too_little.closest.plan in str(too_little),
       "Try: with 4 GiB per rank the search raises NoPlanFits, naming the plan that came closest", seen=too_little.closest.plan)
