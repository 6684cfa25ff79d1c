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
def break_layer_1(broken):
    """On a rank: GPT-2's TP plan with plain colwise for block 1's c_attn only (False: as shipped)."""
    import dataclasses
    from interactive_parallel.plan import models
    family = models.FAMILIES["gpt2"]
    tp_plan = {k: v for k, v in family.tp_plan.items() if k != "transformer.h.1.attn.c_attn"}
    if broken:
        tp_plan["transformer.h.1.attn.c_attn"] = "colwise"    # after the pattern "transformer.h.*...": it wins
    models.FAMILIES["gpt2"] = dataclasses.replace(family, tp_plan=tp_plan)
    return broken

s.run(break_layer_1, True)
s.load_model("tiny-gpt2")
s.apply(plan)
layer_1 = s.run(compare_activations, names)[0]
s.run(break_layer_1, False)
for name, diff in layer_1:
    print(f"{name:24} {diff:.1e}")
# %%
still = [name for name, diff in layer_1 if diff <= 1e-5]
expect(still == names[:6], "Q2: with only layer 1 broken, everything in names up to the output of layer 0 still matches",
       seen=still)
