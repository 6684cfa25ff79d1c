"""The tour's **Try:** paragraph, on its session at the end (pp=2 x dp=2; `mem` is the memory of the
dp=4 steps); and the communication section's "(try `s.train(steps=1, batch_size=32)`)", under dp=4
before the layout section re-plans."""
# %%
s.apply(Plan(fsdp=4, batch_size=16, seq_len=64, lr=3e-3))
s.train(steps=3)
sharded = s.memory()
viz.memory_figure(s.memory(), s.predict_memory())
# %%
ratio = {k: getattr(sharded[0], k) / getattr(mem[0], k) for k in ("params", "grads", "optimizer", "activations")}
expect(all(0.24 < ratio[k] < 0.27 for k in ("params", "grads", "optimizer")) and 0.9 < ratio["activations"] < 1.1,
       "Try: under fsdp=4 the parameter, gradient and optimizer bars are a quarter of dp=4's, the activations as tall",
       seen={k: round(v, 2) for k, v in ratio.items()})
# %%
s.train(steps=3, seq_len=32)
shorter = s.memory()
# %%
expect(all(b.activations < 0.6 * a.activations and (a.params, a.grads, a.optimizer) == (b.params, b.grads, b.optimizer)
           for a, b in zip(sharded, shorter)),
       "Try: at half the sequence length only the activation bars shrink",
       seen=f"{mib(sharded[0].activations)} -> {mib(shorter[0].activations)}")
# %%
%%px
t = torch.ones(2) * (rank + 1)
dist.broadcast(t, src=3)
print(f"rank {rank}: {t.tolist()}")
# %%
broadcast = [t.tolist() for t in s.view.pull("t")]
expect(broadcast == [[4.0, 4.0]] * 4, "Try: dist.broadcast(t, src=3) in place of all_reduce leaves rank 3's (4, 4) on every rank",
       seen=broadcast)
# %% before: s.apply(Plan(dp=2, tp=2, batch_size=16, seq_len=64, lr=3e-3))
s.train(steps=1, batch_size=32)
comms32 = s.comms()
# %%
per_rank = {r: sum(c.bytes for c in comms32 if c.rank == r) for r in range(4)}
expect(len(set(per_rank.values())) == 1 and 0 <= per_rank[0] - mem[0].grads <= 4,
       "(try, communication section) at batch 32 the bytes per step are still the gradients' (plus the stop vote)",
       seen=(per_rank[0], mem[0].grads))
