"""Notebook 07's questions, on its session at the end (pp=4 on tiny-llama; `big_act`, `reports` from
sections 1 and 2)."""
# %%
from collections import Counter

s.load_model("tiny-llama")
s.apply(Plan(fsdp=4, batch_size=32, seq_len=64, lr=3e-3))
s.train(steps=1)
whole = Counter(c.op for c in last_step(s.comms()))
s.train(steps=1, grad_accum=4)
accumulated = Counter(c.op for c in last_step(s.comms()))
print("one optimizer step, rank 0: batch 32 in one go", dict(whole), "| 4 micro-steps", dict(accumulated))
# %%
expect(accumulated["reduce_scatter"] == 4 * whole["reduce_scatter"] > 0
       and accumulated["all_gather"] == 4 * whole["all_gather"],
       "Q1: under fsdp=4 accumulation multiplies the collectives: each of the 4 micro-steps gathers the weights and "
       "reduce-scatters the gradients again", seen={"once": dict(whole), "accumulated": dict(accumulated)})
# %%
s.apply(Plan(dp=4, batch_size=16, seq_len=64, lr=3e-3))
s.train(steps=1)
fp32 = s.memory()[0]
s.apply(Plan(dp=4, batch_size=16, seq_len=64, lr=3e-3, precision="bf16"))
s.train(steps=1)
bf16 = s.memory()[0]
# %%
expect((fp32.params, fp32.grads, fp32.optimizer) == (bf16.params, bf16.grads, bf16.optimizer) and fp32.activations != bf16.activations,
       "Q2: with precision=\"bf16\" only the activation bar changes: parameters, gradients and optimizer state stay fp32",
       seen=f"activations {mib(fp32.activations)} -> {mib(bf16.activations)}")
# %%
from interactive_parallel.plan import resolve_model
from interactive_parallel.plan.estimate import predict_memory

small = resolve_model("small-llama")
total = lambda plan: [m.params + m.grads + m.optimizer + m.activations for m in predict_memory(small, plan)]
pp4 = Plan(pp=4, batch_size=16, seq_len=64, microbatches=4)
smaller = {"microbatches=8": total(pp4.replace(microbatches=8)), "recompute=full": total(pp4.replace(recompute="full"))}
# %%
expect(total(pp4).index(max(total(pp4))) == 0 and all(max(v) < max(total(pp4)) for v in smaller.values()),
       "Q3: under pp=4 on small-llama rank 0 (stage 0, most microbatches in flight) needs the most; smaller "
       "microbatches or recomputation bring it down",
       seen={"pp4": mib(max(total(pp4))), **{k: mib(max(v)) for k, v in smaller.items()}})
