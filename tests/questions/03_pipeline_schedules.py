"""Notebook 03's questions 1 and 3 need its 4-rank session (pp=4 on small-llama), as the notebook says:
they run before the zero-bubble section stops it."""
# %% before: ## Zero bubble: the schedule before it runs
run("1f1b, m=16", pp_schedule="1f1b", microbatches=16)
# %%
print(f"step time (s.history[-1].time_s): {s.history[-1].time_s:.3f} s at m=16")
ev16 = latest(runs["1f1b, m=16"][0])
own16, measured16 = mean(replay(order(ev16))), mean(idle_per_rank(runs["1f1b, m=16"][0]))
expect(abs(own16 - formula(4, 16)) < 1e-9, "Q1: at m=16 the replayed bubble is the formula's 3/19", seen=f"{own16:.1%}")
expect(measured16 > formula(4, 16), "Q1: the measured one stays above it (four ranks share the cores)",
       seen=f"{measured16:.0%} against {formula(4, 16):.0%}")
# %%
mem4 = runs["1f1b, m=4"][1]
expect(mem4[3].params > mem4[1].params and mem4[3].activations == min(m.activations for m in mem4),
       "Q2: the last stage holds the LM head (more parameters than a middle stage) and the fewest activations",
       seen={m.rank: (f"{m.params / 2**20:.1f} MiB", f"{m.activations / 2**20:.1f} MiB") for m in mem4})
# %%
s.apply(Plan(pp=2, dp=2, microbatches=4, batch_size=16, seq_len=32))
s.train(steps=1)
tl = s.timeline()
viz.timeline_figure(tl, tl)
# %%
raw = s.timeline(raw=True)                 # one host, one clock: the order is exact
step = max(e.step for e in raw if getattr(e, "kind", "") == "pipeline")
last_backward = {r: max(e.start for e in raw if getattr(e, "kind", "") == "pipeline" and e.step == step and e.rank == r
                        and e.action == "B") for r in range(4)}
reduces = [c for c in raw if getattr(c, "kind", "") == "comm" and c.step == step and c.op == "all_reduce"]
expect(reduces and all(c.axis == "dp" and c.start >= last_backward[c.rank] for c in reduces),
       "Q3: the gradient all-reduces (dp) come at the end of the step, from each rank's last backward on",
       seen=sorted({tuple(c.group) for c in reduces}))
