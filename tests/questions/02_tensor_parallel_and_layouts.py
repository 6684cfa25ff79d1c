"""Notebook 02's questions, on its session at the end (tp=4 with sequence parallel, tiny-llama)."""
# %%
from interactive_parallel import PlanError

try:
    s.check_plan(Plan(tp=3, dp=1))
except PlanError as err:
    refusal = str(err)
print(refusal)
# %%
reasons = [line for line in refusal.splitlines() if line.strip().startswith("- ")]
expect(len(reasons) > 2 and "tp(3) = 3 != ranks(4)" in refusal and "tp(3) does not divide num_attention_heads(4)" in refusal,
       "Q1: check_plan lists every reason tp=3 cannot run: 3 ranks of 4, and 3 divides none of the split widths",
       seen=len(reasons))
# %%
s.apply(Plan(dp=2, tp=2, batch_size=8, seq_len=64, lr=3e-3))
s.train(steps=1)
grouped = s.comms()
# %%
groups = lambda axis: sorted({tuple(sorted(c.group)) for c in grouped if c.axis == axis})
dp_ops = {(c.op, c.phase) for c in grouped if c.axis == "dp"}
expect(groups("tp") == [(0, 1), (2, 3)] and groups("dp") == [(0, 2), (1, 3)],
       "Q3: under dp=2, tp=2 ranks 0-1 and 2-3 form the TP groups; the dp all-reduces pair 0-2 and 1-3",
       seen={"tp": groups("tp"), "dp": groups("dp")})
expect(dp_ops == {("all_reduce", "backward")}, "Q3: over dp go only the gradients' all-reduces, in the backward", seen=dp_ops)
# %%
s.load_model("tiny-gpt2")
s.apply(Plan(tp=4, batch_size=8, seq_len=64, lr=3e-3))
c_attn = {r.rank: r for r in s.layout() if r.param == "transformer.h.0.attn.c_attn.weight"}
# %%
width = c_attn[0].global_shape[1] // 3            # q, k, v side by side along dim 1 (GPT-2's Conv1D)
plain = range(*c_attn[0].index[1])                 # a plain colwise split takes these columns as they are
expect(c_attn[0].index[1] == [0, width * 3 // 4] and max(plain) < width,
       "Q2: a plain colwise split of c_attn gives rank 0 its first quarter of the columns: three of q's four heads, no k, no v",
       seen=c_attn[0].index)
