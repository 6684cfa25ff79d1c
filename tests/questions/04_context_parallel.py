"""Notebook 04's questions, on its session at the end (cp=4 with the ring, tiny-llama)."""
# %%
from interactive_parallel import PlanError

try:
    s.check_plan(Plan(cp=4, batch_size=1, seq_len=60))
except PlanError as err:
    refusal = str(err)
print(refusal)
# %%
expect("seq_len(60) is not divisible by 2 * cp(4) = 8" in refusal,
       "Q1: the refusal says why: the load-balanced split cuts the sequence into 2 · cp chunks", seen=refusal.splitlines()[-1].strip())
# %%
S, cp = 256, 4
pairs = lambda positions: sum(p + 1 for p in positions)     # (query, key) pairs a causal mask lets through
plain = {r: pairs(range(r * S // cp, (r + 1) * S // cp)) for r in range(cp)}
balanced = {r: pairs(shard_sequence(torch.arange(S)[None], cp, r)[0].tolist()) for r in range(cp)}
# %%
expect(max(plain, key=plain.get) == 3 and 6.5 < plain[3] / plain[0] < 7 and len(set(balanced.values())) == 1,
       "Q2: chunk r only: the last rank attends most, nearly 2·cp - 1 = 7 times rank 0; the balanced split evens it",
       seen={"plain": plain, "balanced": balanced})
# %%
s.load_model("small-llama")
gather = s.predict_memory(Plan(cp=4, batch_size=1, seq_len=16384))[0].activations
ring = s.predict_memory(Plan(cp=4, batch_size=1, seq_len=16384, cp_method="ring"))[0].activations
extra = {16384: (gather - ring) / gather}
for seq_len in (256, 4096):                 # the same at shorter sequences, to see it grow
    shorter = [s.predict_memory(Plan(cp=4, batch_size=1, seq_len=seq_len, cp_method=m))[0].activations for m in ("allgather", "ring")]
    extra[seq_len] = (shorter[0] - shorter[1]) / shorter[0]
for seq_len, share in sorted(extra.items()):
    print(f"seq_len {seq_len:6}: the all-gather's extra is {share:.0%} of its activations")
# %%
expect(extra[256] < extra[4096] < 0.5 < extra[16384],
       "Q3: the all-gather's extra (the mask grows with seq², the K/V with seq) makes up most of small-llama's "
       "activations by 16k tokens", seen={k: f"{v:.0%}" for k, v in extra.items()})
