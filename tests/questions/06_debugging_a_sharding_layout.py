"""Notebook 06's questions, on its session at the end (tp=2 on tiny-gpt2, c_attn restored)."""
# %%
s.run(set_tp_style, "rowwise", "mlp.c_fc")
loud = None
try:
    s.load_model("tiny-gpt2")
    s.apply(plan)
    s.train(steps=1)
except RankError as err:
    loud = str(err).splitlines()[0]
    print(loud)
# %%
shapes = re.search(r"\[(\d+), (\d+)\] X \[(\d+), (\d+)\]", loud or "")
expect(loud is not None and loud.startswith("rank ") and shapes is not None and int(shapes.group(2)) == 2 * WIDTH,
       "Q1: a rowwise c_fc fails loudly: it reads its whole 64 input features as its half, 128 wide against 64 rows",
       seen=loud)
# %%
s.run(set_tp_style, "colwise", "mlp.c_fc")
s.load_model("tiny-gpt2")
s.apply(plan)
put_back = s.verify()
# %%
expect(put_back.ok, "Q1: colwise puts c_fc back: the parity check passes again", seen=f"|dloss| {put_back.dloss:.1e}")
# %%
# Only layer 1 broken is not a plan this notebook can make (a TP plan's patterns cover every layer), so
# the answer is read off the measured differences: a module's output differs from the first broken
# module on (every later one reads it) and matches before it, so with layer 1 broken the modules of
# `names` up to transformer.h.0 would still match.
order = [name for name, _ in diffs]
first_off = order.index(first_diff)
expect(order == names and all(diff <= 1e-5 for _, diff in diffs[:first_off]) and all(diff > 1e-5 for _, diff in diffs[first_off:]),
       "Q2: in names every module before the first broken one matches and every one from it on differs, so with only "
       "layer 1 broken transformer.wte through transformer.h.0 would match", seen=[f"{d:.0e}" for _, d in diffs])
