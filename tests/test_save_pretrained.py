"""Session.save_pretrained: a directory transformers itself loads, written under sharded layouts.

The oracle is transformers: AutoModelForCausalLM and AutoTokenizer load the directory in this
process, its weights equal the session's full weights exactly (layouts whose pieces differ:
tp, fsdp, pp, dp; GPT-2's tied head, Conv1D and fused c_attn stored permuted under tp), and its
greedy generate equals Session.generate's text token for token. Refusals come before any
rank is touched. One 2-rank live session for the module.
"""
from __future__ import annotations

import json
import os

import pytest
from safetensors import safe_open

from conftest import live_session
from interactive_parallel import Plan
from interactive_parallel.cluster.checkpoints import MANIFEST
from interactive_parallel.cluster.errors import RankError, SessionError
from interactive_parallel.runtime import api

pytestmark = pytest.mark.session
BATCH = dict(batch_size=8, seq_len=32)
PROMPTS = ["12+35=", "3+4=", "7*8=9"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def s():
    with live_session(2) as session:
        yield session


def _trained(s, preset: str, **fields) -> dict:
    """The session's full weights after 3 steps of `preset` under Plan(**fields)."""
    s.load_model(preset)
    s.apply(Plan(**fields, **BATCH))
    s.train(steps=3, snapshot_every=0)
    return s.run(api.full_state_dict)[0]


def _max_dw(path: str, full: dict) -> float:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()
    assert set(loaded) == set(full)
    return max((loaded[k] - v).abs().max().item() for k, v in full.items())


def _transformers_generate(path: str) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def _saved_names(path: str) -> set[str]:
    names: set[str] = set()
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as st:
                names |= set(st.keys())
    return names


def test_a_tensor_parallel_llama_loads_in_transformers_and_generates_the_same(s, tmp_path):
    full = _trained(s, "tiny-llama", tp=2)
    path = s.save_pretrained(str(tmp_path / "llama"))
    assert sorted(os.listdir(path)) == sorted(["config.json", "generation_config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json", MANIFEST])
    assert os.listdir(tmp_path) == ["llama"]  # no staging or pieces left beside or inside
    assert _max_dw(path, full) == 0
    texts = _transformers_generate(path)
    assert texts == s.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert any(texts)  # something was generated to compare
    with pytest.raises(FileNotFoundError, match=r"transformers directory .* load_model"):
        s.load(path)


@pytest.mark.parametrize("fields", [dict(fsdp=2), dict(pp=2)], ids=["fsdp2", "pp2"])
def test_saved_weights_equal_the_full_weights_under_other_layouts(s, tmp_path, fields):
    full = _trained(s, "tiny-llama", **fields)
    path = s.save_pretrained(str(tmp_path / "llama"))
    assert _max_dw(path, full) == 0


def test_gpt2_under_tp_keeps_the_tied_head_out_and_c_attn_in_checkpoint_order(s, tmp_path):
    full = _trained(s, "tiny-gpt2", tp=2)
    path = s.save_pretrained(str(tmp_path / "gpt2"))
    names = _saved_names(path)
    assert "lm_head.weight" not in names and "transformer.h.0.attn.c_attn.weight" in names
    assert _max_dw(path, full) == 0  # c_attn is stored permuted under tp; saved unpermuted
    assert _transformers_generate(path) == s.generate(PROMPTS, max_new_tokens=NEW_TOKENS)


def test_a_small_shard_size_gives_an_index_and_several_files_and_loads_back(s, tmp_path):
    full = _trained(s, "tiny-llama", dp=2)
    path = s.save_pretrained(str(tmp_path / "llama"), max_shard_size="200KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    files = set(weight_map.values())
    assert len(files) > 3 and set(weight_map) == set(full)
    assert {f for f in os.listdir(path) if f.endswith(".safetensors")} == files
    for f in files:
        assert os.path.getsize(os.path.join(path, f)) <= 200_000 + 4096  # + its header
    assert _max_dw(path, full) == 0
    s.load_model(path)  # and back into a session, under another layout
    s.apply(Plan(tp=2, **BATCH))
    again = s.run(api.full_state_dict)[0]
    assert max((again[k] - v).abs().max().item() for k, v in full.items()) == 0


def test_a_foreign_directory_a_bad_size_and_a_quantized_model_are_refused(s, tmp_path, monkeypatch):
    s.load_model("tiny-llama")
    s.apply(Plan(dp=2, **BATCH))
    ours = s.save_pretrained(str(tmp_path / "ours"))
    assert s.save_pretrained(ours) == ours  # ours: replaced
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    monkeypatch.setattr(s.ranks.caller, "submit", lambda *a, **k: pytest.fail("a rank was touched"))
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        s.save_pretrained(str(foreign))
    assert os.listdir(foreign) == ["notes.txt"]
    with pytest.raises(ValueError, match="not supported"):
        s.save_pretrained(str(tmp_path / "bad"), max_shard_size="5 parsecs")
    with pytest.raises(ValueError, match="positive"):
        s.save_pretrained(str(tmp_path / "bad"), max_shard_size=0)
    monkeypatch.undo()
    s.quantize("int8-weight-only")
    try:
        monkeypatch.setattr(s.ranks.caller, "submit", lambda *a, **k: pytest.fail("a rank was touched"))
        with pytest.raises(SessionError, match=r"quantized \(int8-weight-only\): save_pretrained needs"):
            s.save_pretrained(str(tmp_path / "int8"))
        monkeypatch.undo()
        with pytest.raises(RankError, match="save_pretrained needs full-precision"):  # the ranks refuse too
            s.run(api.save_pretrained, str(tmp_path / "int8-rank"), 10**9)
    finally:
        s.dequantize()
    assert not (tmp_path / "int8").exists() and not (tmp_path / "bad").exists()
