"""Notebook 10's **Try:** paragraph, at its end (`win` is the search's winner on 80 GB H100s)."""
# %%
from interactive_parallel.plan.search import NoPlanFits

tight = search_plans("llama-3-70b", 256, "h100", batch_size=256, seq_len=8192, top=5, memory_per_rank=12 * GiB)
held = search_plans("llama-3-70b", 256, "h100", batch_size=256, seq_len=8192, top=1, tp=8)[0]
h200 = search_plans("llama-3-70b", 256, "h200", batch_size=256, seq_len=8192, top=1)[0]
try:
    search_plans("llama-3-70b", 256, "h100", batch_size=256, seq_len=8192, top=5, memory_per_rank=4 * GiB)
except NoPlanFits as err:
    too_little = err
for label, r in (("80 GB winner", win), ("12 GiB winner", tight[0]), ("tp=8", held), ("h200 winner", h200)):
    print(f"{label:14} {r.plan:34} {r.seconds:5.2f} s, {r.memory_bytes / GiB:5.1f} GiB")
print(type(too_little).__name__ + ":", str(too_little).splitlines()[-1].strip(), "| closest:", too_little.closest.plan)
# %%
fields, slower = tight[0].plan_fields, (tight[0].seconds - win.seconds) / win.seconds
expect(fields["tp"] > win.plan_fields["tp"] and tight[0].memory_bytes <= 12 * GiB < win.memory_bytes
       and 0.3 < slower < 0.7, "Try: at 12 GiB the winner needs more tensor parallelism, and its step grows by about half",
       seen=f"{tight[0].plan}, {slower:.0%} slower")
expect(held.seconds > win.seconds, "Try: holding tp=8 costs time", seen=f"{held.seconds:.2f} s")
expect(h200.plan == win.plan and h200.seconds < win.seconds, "Try: on the h200 profile the same winner, faster",
       seen=f"{h200.plan}, {h200.seconds:.2f} s")
expect(too_little.closest is not None and too_little.closest.plan in str(too_little),
       "Try: with 4 GiB per rank the search raises NoPlanFits, naming the plan that came closest", seen=too_little.closest.plan)
