"""Notebook 08's questions, on its session at the end (tp=4 on the trained tiny-llama, full precision;
`requests`, `served` are the serving cell's, `q` the int8 quantization's records)."""
# %%
sampled = {}
for plan in (Plan(tp=4), Plan(dp=4)):
    s.apply(plan.replace(batch_size=16, seq_len=64, lr=3e-3))
    sampled[plan.describe()] = s.generate(prompts, 4, do_sample=True, temperature=0.8, seed=1)
again = s.generate(prompts, 4, do_sample=True, temperature=0.8, seed=1)
print(sampled)
# %%
# Each dp replica samples its own 2 prompts from a generator seeded alike, so the random numbers fall
# on other prompts than under tp4, where every rank samples all 8 (seeded the same, the same logits).
expect(again == sampled["dp4"], "Q1: sampling is seeded: the same seed gives the same samples again", seen=again[:3])
print("the same under tp=4 and dp=4:", sampled["tp4"] == sampled["dp4"])
# %%
s.apply(Plan(dp=2, tp=2, batch_size=16, seq_len=64, lr=3e-3))
narrow = s.serve(requests, max_batch=2)
tight = s.serve(requests, max_batch=4, kv_tokens=40)
for name, res in (("max_batch=4", served), ("max_batch=2", narrow), ("kv_tokens=40", tight)):
    print(f"{name:12} {res.n_steps} steps, {sum(st.waiting for st in res.steps)} request-steps waiting")
viz.request_timeline_figure(narrow.requests, title="max_batch=2")
# %%
waiting = lambda res: sum(st.waiting for st in res.steps)
expect(narrow.texts == tight.texts == served.texts, "Q2: the texts do not change, only when each request runs")
expect(narrow.n_steps > served.n_steps and waiting(narrow) > waiting(served),
       "Q2: max_batch=2 takes more steps, and the timeline's grey waits grow",
       seen=f"{served.n_steps} -> {narrow.n_steps} steps, {waiting(served)} -> {waiting(narrow)} request-steps waiting")
expect(tight.n_steps >= served.n_steps and waiting(tight) >= waiting(served),
       "Q2: kv_tokens=40 admits a request only while its cache fits: as many steps or more, and longer waits",
       seen=f"{tight.n_steps} steps, {waiting(tight)} request-steps waiting")
# %%
s.apply(Plan(dp=4, batch_size=16, seq_len=64, lr=3e-3))
q4 = s.quantize("int4-weight-only")
s.apply(Plan(tp=4, batch_size=16, seq_len=64, lr=3e-3))
try:
    s.quantize("int4-weight-only")
    under_tp4 = None
except ValueError as err:
    under_tp4 = str(err)
print(f"greedy tokens unchanged: int8 {q[0].agreement:.0%}, int4 {q4[0].agreement:.0%}; under tp4: {under_tp4}")
# %%
# 16 levels a weight against int8's 256: int4 keeps fewer greedy tokens; on CPU torchao stores each int4
# value in a byte, with a scale per group of 32 (plan.inference.QUANT_SCHEMES), so it saves no bytes here
kept8, kept4 = (sum(r.agreement for r in recs) / len(recs) for recs in (q, q4))
expect(kept4 <= kept8 and q4[0].params_after >= q[0].params_after,
       "Q3: int4 changes at least as many greedy tokens as int8, and on CPU (a byte a value, a scale per 32) "
       "holds no fewer bytes", seen=f"{kept8:.0%} -> {kept4:.0%} unchanged; "
                                    f"{mib(q[0].params_after)} -> {mib(q4[0].params_after)}")
expect(under_tp4 is not None and "groups of 32 input features" in under_tp4 and s.quantization is None,
       "Q3: under Plan(tp=4) int4 is refused before any rank runs: o_proj's 64 input features split in 4 hold "
       "no whole group of 32", seen=under_tp4)
