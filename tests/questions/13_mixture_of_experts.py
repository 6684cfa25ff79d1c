"""Notebook 13's questions, on its session at the end (dp=4 x ep=4 on the Mixtral shape; `dp_params`
and `expert_bytes` are the notebook's)."""
# %%
s.load_model(mixtral)
s.apply(Plan(dp=4, ep=2, batch_size=8, seq_len=32, lr=3e-4))
s.train(steps=3, data=TEXT)
display(expert_load_figure(s.experts(1)), tokens_moved_figure(s.experts(1), layer=0))
print(s.memory(), s.verify().ok)
# %%
ep2 = [r for r in s.experts(1) if r.layer == 0]
held = {r.rank: r.experts for r in ep2}
groups = {r.rank: r.ep_group for r in ep2}
replica = sorted({tuple(c.group) for c in s.comms() if str(c.axis) == "ep_replica"})
print("held:", held, "| ep_group:", groups, "| ep_replica groups:", replica)
expect(all(len(e) == E // 2 for e in held.values()) and all(len(g) == 2 for g in groups.values()),
       "Q1: under ep=2 each rank holds 4 of the 8 experts, and sends tokens within an ep_group of 2", seen=held)
expect(replica and all(len({tuple(held[r]) for r in g}) == 1 for g in replica)
       and all(dp_params[m.rank] - m.params == expert_bytes // 2 for m in s.memory()),
       "Q1: the ranks of an ep_replica group hold the same experts; each rank keeps half the expert bytes",
       seen={"ep_replica": replica, "params": s.memory()[0].params})
# %%
s.load_model(dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64,
   intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
   num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
   max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2))
print(s.spec.experts.expert_params, s.spec.experts.expert_width)
# %%
expect(s.spec.experts.expert_width == 32 and s.spec.experts.expert_params == {"gate_up_proj": (2 * 32, 64), "down_proj": (64, 32)},
       "Q2: a Qwen3-MoE's experts are moe_intermediate_size = 32 wide (gate and up 32 each), not intermediate_size",
       seen=s.spec.experts.expert_params)
# %%
s.load_model(mixtral)
s.apply(Plan(dp=2, tp=2, ep=2, batch_size=8, seq_len=32, lr=3e-4))
s.train(steps=1, data=TEXT)
both = s.experts(1)
# %%
second = sorted({r.rank for r in both if r.tp_rank == 1})
expect(second == [1, 3] and all(sum(row) == B * T * K for row in expert_load(both).values()),
       "Q3: ranks 1 and 3 are tp rank 1; each tp rank's experts process its slice of the tokens, so the load "
       "counts both and still sums to 8 x 32 x 2 pairs a layer", seen={"tp_rank 1": second})
# %%
curves = {}
for name, config in (("lr=1e-3", mixtral),
                     ("and the load-balancing loss", dict(mixtral, output_router_logits=True, router_aux_loss_coef=0.1))):
    s.load_model(config)
    s.apply(Plan(dp=4, ep=4, batch_size=8, seq_len=32, lr=1e-3))
    s.train(steps=8, data=TEXT)
    curves[name] = [round(imbalance(expert_load(s.experts(), step=st)), 2) for st in sorted({r.step for r in s.experts()})[-8:]]
print(curves)
# %%
plain, balanced = curves.values()
expect(plain[-1] > plain[0], "Q4: at lr=1e-3 the imbalance climbs over 8 steps", seen=plain)
expect(balanced[-1] < plain[-1], "Q4: the load-balancing loss holds the curve down", seen=balanced)
