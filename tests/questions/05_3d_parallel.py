"""Notebook 05's questions, on its session at the end (8 ranks, pp=2 x dp=2 x tp=2 on small-llama cut to 4 layers; `mem`
is that plan's measured memory)."""
# %%
viz.memory_figure(s.memory(), s.predict_memory(plan.replace(dp=1, fsdp=2)))
# %%
swapped = s.predict_memory(plan.replace(dp=1, fsdp=2))[0]
ratio = {k: getattr(swapped, k) / getattr(mem[0], k) for k in ("params", "grads", "optimizer", "activations")}
expect(all(0.49 < ratio[k] < 0.52 for k in ("params", "grads", "optimizer")) and 0.9 < ratio["activations"] < 1.1,
       "Q1: fsdp=2 in place of dp=2 halves the parameter, gradient and optimizer bars; the activations stay",
       seen={k: round(v, 2) for k, v in ratio.items()})
# %%
machine = lambda rank: rank // 4                     # 2 machines of 4 GPUs: ranks 0-3 and 4-7
crossing = {str(axis): all(len({machine(r) for r in g}) > 1 for g in axis_groups(plan.mesh_shape, axis))
            for axis in (MeshAxis.PP, MeshAxis.DP, MeshAxis.TP)}
expect(crossing == {"pp": True, "dp": False, "tp": False},
       "Q3: on 2 machines of 4, the pp axis crosses the machine boundary; tp and dp groups stay inside a machine",
       seen=crossing)
