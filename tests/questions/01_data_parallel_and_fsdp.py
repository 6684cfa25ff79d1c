"""Notebook 01's questions, on its session at the end (fsdp=4 on tiny-llama; `ddp_mem`, `fsdp_mem` and
`fsdp_comms` are the notebook's records of 15 steps at batch 16)."""
# %%
s.train(steps=3, batch_size=32)
doubled, doubled_comms = s.memory(), s.comms()
# %%
rank0 = lambda comms: sum(c.bytes for c in comms if c.rank == 0)
expect(all((m.params, m.grads, m.optimizer) == (f.params, f.grads, f.optimizer) for m, f in zip(doubled, fsdp_mem))
       and all(1.8 < m.activations / f.activations < 2.2 for m, f in zip(doubled, fsdp_mem)),
       "Q1: twice the batch doubles the activation bars only (parameters, gradients, optimizer as before)",
       seen=f"activations {mib(fsdp_mem[0].activations)} -> {mib(doubled[0].activations)}")
expect(rank0(doubled_comms) == rank0(fsdp_comms), "Q1: the communicated bytes do not change: they are the weights' and gradients'",
       seen=rank0(doubled_comms))
# %%
hsdp = s.predict_memory(Plan(dp=2, fsdp=2, batch_size=16, seq_len=64))
# %%
half = {k: getattr(hsdp[0], k) / getattr(ddp_mem[0], k) for k in ("params", "grads", "optimizer", "activations")}
expect(all(0.49 < half[k] < 0.52 for k in ("params", "grads", "optimizer")) and 0.9 < half["activations"] < 1.1,
       "Q2: against DDP, dp=2 x fsdp=2 halves the parameters, gradients and optimizer state; activations stay",
       seen={k: round(v, 3) for k, v in half.items()})
# %%
s.load_model("small-llama")
small = {}
for plan in (Plan(dp=4, batch_size=4, seq_len=32, lr=3e-3), Plan(fsdp=4, batch_size=4, seq_len=32, lr=3e-3)):
    s.apply(plan)
    s.train(steps=1)
    small[plan.describe()] = s.memory()[0]
# %%
(dp4, fsdp4), state = small.values(), lambda m: m.params + m.grads + m.optimizer
expect(abs(state(fsdp4) / state(dp4) - state(fsdp_mem[0]) / state(ddp_mem[0])) < 0.01 and state(dp4) > 20 * state(ddp_mem[0]),
       "Q3: on small-llama fsdp=4 holds the same quarter of dp=4's state, of many more megabytes",
       seen=f"{mib(state(dp4))} -> {mib(state(fsdp4))} against {mib(state(ddp_mem[0]))} -> {mib(state(fsdp_mem[0]))}")
