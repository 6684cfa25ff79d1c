"""Notebook 12's questions, on its session at the end (2 ranks, the trained Qwen3 under tp=2; `plan`,
`tok`, `vocab_size`, `tmp` are the notebook's)."""
# %%
tp_state = s.memory()
s.apply(Plan(fsdp=2, batch_size=8, seq_len=64))
s.train(steps=1)
measured, predicted = s.memory(), s.predict_memory(s.plan)
report = s.verify()
resaved = AutoModelForCausalLM.from_pretrained(s.save_pretrained(os.path.join(tmp.name, "my-qwen3-fsdp"))).state_dict()
full = s.run(api.full_state_dict)[0]
diff = max((resaved[k] - v).abs().max().item() for k, v in full.items())
for kind in ("params", "grads", "optimizer", "activations"):
    print(f"{kind:>12} tp=2 {getattr(tp_state[0], kind) / 2**20:7.3f}  fsdp=2 {getattr(measured[0], kind) / 2**20:7.3f} "
          f"predicted {getattr(predicted[0], kind) / 2**20:7.3f} MiB")
print("verify:", report.ok, "| largest |saved - session|:", diff)
# %%
whole = sum(v.numel() * v.element_size() for v in full.values())
expect(all((m.params, m.grads, m.optimizer) == (p.params, p.grads, p.optimizer) for m, p in zip(measured, predicted))
       and report.ok and diff == 0,
       "Q1: under fsdp=2 the measured state still equals the prediction, verify() passes, the saved weights equal the session's")
expect(abs(measured[0].params - whole / 2) <= 0.01 * whole and tp_state[0].params > measured[0].params,
       "Q1: the parameter, gradient and optimizer rows fall: fsdp=2 shards every weight in two, tp=2 left the embedding, "
       "head and norms whole", seen=f"{mib(tp_state[0].params)} -> {mib(measured[0].params)} of {mib(whole)}")
# %%
s.apply(Plan(pp=2, batch_size=8, seq_len=64))
s.train(steps=1)
piped, report = s.memory(), s.verify()
# %%
expect(report.ok and all((m.params, m.grads, m.optimizer) == (p.params, p.grads, p.optimizer)
                         for m, p in zip(piped, s.predict_memory(s.plan))),
       "Q1: under pp=2 too the measured state equals the prediction, and verify() passes", seen=[mib(m.params) for m in piped])
# %%
from transformers import Gemma3TextConfig, Phi3Config

facts = {}
for config_class in (Phi3Config, Gemma3TextConfig):
    other = config_class(vocab_size=vocab_size, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_hidden_layers=4, intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    other_dir = os.path.join(tmp.name, config_class.__name__)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(other).save_pretrained(other_dir)
    tok.save_pretrained(other_dir)
    s.load_model(other_dir)
    facts[config_class.__name__] = (s.spec.facts.tp_plan, s.spec.facts.norm_paths)
    print(config_class.__name__, s.spec.facts.norm_paths, s.spec.facts.tp_plan)
# %%
expect(all(tp_plan == {f"model.{k}": v for k, v in c.base_model_tp_plan.items()} for c, (tp_plan, _) in
           ((Phi3Config, facts["Phi3Config"]), (Gemma3TextConfig, facts["Gemma3TextConfig"]))),
       "Q2: the TP plan is each config's own base_model_tp_plan, prefixed with model.")
expect(len(facts["Gemma3TextConfig"][1]) == 4 and len(facts["Phi3Config"][1]) == 2,
       "Q2: Gemma 3's block holds four norms (before and after attention and MLP), Phi-3's two",
       seen={k: v[1] for k, v in facts.items()})
# %%
import json

own = os.path.join(tmp.name, "own.jsonl")           # a file of your own: one {"text": ...} per paragraph
with open(own, "w") as f:
    f.writelines(json.dumps({"text": p}) + "\n" for p in text.split("\n\n") if p.strip())
trained = s.train(1, data=own)
before = len(s.history)
try:
    s.train(1, data="nowhere.txt")
except ValueError as err:
    nowhere = err
print(type(nowhere).__name__ + ":", nowhere)
# %%
expect(len({r.step for r in trained}) == 1, "Q3: a .jsonl with a text string on every line trains")
expect(type(nowhere).__name__ == "DataError" and "nowhere.txt" in str(nowhere) and len(s.history) == before,
       "Q3: a missing file is a DataError naming it, raised before any rank runs a step", seen=str(nowhere))
