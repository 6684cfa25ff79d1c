"""Bring your own model and text: a model directory's own tokenizer, and training on a text file,
a .jsonl or a datasets directory instead of the package's additions.

Pure: the client's refusals of a text (missing, empty, a .jsonl line without a text, an unknown
kind, datasets without the package, shorter than one batch) and the packing (documents joined by
the end-of-sequence token, rows of seq_len + 1, a batch the same for the same seed and step,
data-parallel slices disjoint and together the global batch, one epoch reading every row once).
One rank in this process: a BPE tokenizer trained here with `tokenizers` beside a tiny llama
saved by transformers; its ids in the batches, its text out of generate, an embedding smaller
than its vocabulary refused. A live session of 2 ranks: generate on the directory model equal
to transformers' own generate decoded by that tokenizer, 2 steps under dp2 on a text file,
verify() at parity, and a short or missing text refused before any rank trains.
"""
from __future__ import annotations

import json
import random

import pytest

from interactive_parallel.cluster import checks
from interactive_parallel.cluster.checks import DataError
from interactive_parallel.plan import UnknownModelError, resolve_model
from interactive_parallel.records import DataSource

WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly hex a jumbo box of "
         "naive cafe ideas").split()


def prose(lines: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines)) + "\n"


def text_file(tmp_path, lines: int = 60, name: str = "words.txt"):
    path = tmp_path / name
    path.write_text(prose(lines))
    return path


# ---- the client's refusals ------------------------------------------------------------------------

@pytest.mark.pure
def test_a_text_and_a_jsonl_are_taken_and_arithmetic_goes_back_to_the_package_task(tmp_path):
    txt = text_file(tmp_path)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(["one", "two"])) + "\n")
    assert checks.check_data(str(txt)) == DataSource(path=str(txt.resolve()), format="text")
    assert checks.check_data(jsonl) == DataSource(path=str(jsonl.resolve()), format="jsonl")
    assert checks.check_data(checks.ARITHMETIC) is None


@pytest.mark.pure
def test_missing_empty_and_unknown_texts_are_refused_naming_the_path(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        checks.check_data(str(tmp_path / "nowhere.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty.txt' is empty"):
        checks.check_data(str(tmp_path / "empty.txt"))
    (tmp_path / "blank.md").write_text(" \n\n\t\n")
    with pytest.raises(DataError, match=r"is empty \(only blanks\)"):
        checks.check_data(str(tmp_path / "blank.md"))
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match="unknown kind '.csv'"):
        checks.check_data(str(tmp_path / "table.csv"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        checks.check_data(str(tmp_path / "latin1.txt"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="not one written by datasets' save_to_disk"):
        checks.check_data(str(tmp_path / "folder"))
    with pytest.raises(DataError, match="must be a path"):
        checks.check_data(3)


@pytest.mark.pure
def test_a_jsonl_needs_a_text_string_on_every_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n" + "not json\n"
                   + json.dumps({"text": 3}) + "\n")
    with pytest.raises(DataError) as e:
        checks.check_data(str(bad))
    text = str(e.value)
    assert "line 2 has no 'text' string (it holds 'body')" in text and "line 3 is not JSON" in text
    assert "line 4 has no 'text' string" in text
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": ""}) + "\n\n")
    with pytest.raises(DataError, match="no line holds any text"):
        checks.check_data(str(blank))


@pytest.mark.pure
def test_a_datasets_directory_needs_the_datasets_package(tmp_path):
    import importlib.util

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text("{}")
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(DataError, match="datasets package is not installed"):
            checks.check_data(str(saved))
    else:
        assert checks.check_data(str(saved)).format == "datasets"


@pytest.mark.pure
def test_a_text_shorter_than_one_batch_is_refused_with_the_numbers():
    source = DataSource(path="/data/short.txt", format="text")
    with pytest.raises(DataError) as e:
        checks.check_data_length(source, 100, batch_size=8, seq_len=16, model="tiny-llama")
    assert str(e.value) == ("data '/data/short.txt' is shorter than one batch: 100 tokens under tiny-llama's "
                            "tokenizer, and batch_size(8) x (seq_len(16) + 1) = 136")
    checks.check_data_length(source, 136, batch_size=8, seq_len=16)


# ---- packing ----------------------------------------------------------------------------------------

@pytest.mark.pure
def test_documents_are_joined_by_the_end_of_sequence_token_and_cut_into_rows(tmp_path):
    import torch

    from interactive_parallel.runtime.model.tokenizer import get_tokenizer
    from interactive_parallel.runtime.training import data

    tok = get_tokenizer()
    docs = ["12+3=15", "ab", "hello\nworld"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ids = data.token_ids(checks.check_data(path), tok)
    eos = tok.eos_token_id
    assert ids.tolist() == sum(([eos] + tok(d)["input_ids"] for d in docs), [])[1:]
    assert data.token_ids(checks.check_data(path), tok) is ids  # tokenized once
    path.write_text(json.dumps({"text": "changed"}) + "\n")
    assert data.token_ids(checks.check_data(path), tok).tolist() == tok("changed")["input_ids"]

    source = checks.check_data(text_file(tmp_path, lines=20))
    flat = data.token_ids(source, tok)
    batch = data.text_batch(source, tok, seed=0, step=0, batch_size=4, seq_len=15)
    assert batch.shape == (4, 16) and batch.dtype == torch.long
    rows = flat[:flat.numel() // 16 * 16].view(-1, 16)
    assert all(any(torch.equal(r, other) for other in rows) for r in batch)  # whole packed rows, never mixed


@pytest.mark.pure
def test_batches_are_fixed_by_seed_and_step_and_dp_slices_make_the_global_batch(tmp_path):
    import torch

    from interactive_parallel.runtime.model.tokenizer import get_tokenizer
    from interactive_parallel.runtime.training import data

    tok = get_tokenizer()
    source = checks.check_data(text_file(tmp_path, lines=30))
    batch, seq = 8, 15
    n_rows = data.token_ids(source, tok).numel() // (seq + 1)

    def glob(seed, step):
        return data.global_batch(seed, step, batch, seq, tok=tok, source=source)

    assert torch.equal(glob(0, 3), glob(0, 3))
    assert not torch.equal(glob(0, 3), glob(0, 4)) and not torch.equal(glob(0, 3), glob(1, 3))
    for count in (2, 4):
        parts = [data.local_batch(0, 3, batch, seq, i, count, tok=tok, source=source) for i in range(count)]
        assert torch.equal(torch.cat(parts), glob(0, 3))
    with data.reuse_batches():
        assert torch.equal(data.local_batch(0, 3, batch, seq, 1, 2, tok=tok, source=source), glob(0, 3)[4:])
    # one epoch reads every row once: the first n_rows positions of the row order are a permutation
    seen = torch.cat([glob(5, s) for s in range(-(-n_rows // batch))])[:n_rows]
    table = data.token_ids(source, tok)[:n_rows * (seq + 1)].view(n_rows, seq + 1)
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, table.tolist()))
    with pytest.raises(ValueError, match=r"fewer than one batch of batch_size\(99\) x \(seq_len\(15\) \+ 1\)"):
        data.text_batch(source, tok, 0, 0, 99, seq)
    # without a text, the package's additions, as before
    assert torch.equal(data.global_batch(0, 3, batch, seq), data._make_batch(0, 3, batch, seq))


# ---- a model directory with its own tokenizer (one rank, this process) ------------------------------

TOKENS = 300


def bpe_tokenizer():
    """A byte-level BPE of TOKENS tokens trained on `prose`, as transformers wraps it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENS, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([prose(400, seed=1)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def llama_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{"model": a tiny llama with weights and its BPE tokenizer, "small": the same tokenizer beside
    a config whose embedding has fewer rows than it has tokens, "bare": weights, no tokenizer}."""
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("own")
    tok = bpe_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(320))
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    model.save_pretrained(root / "bare")
    llama_config(256).save_pretrained(root / "small")
    tok.save_pretrained(root / "small")
    return {name: root / name for name in ("model", "small", "bare")}


@pytest.mark.rank1
def test_a_directory_with_a_tokenizer_uses_it_and_presets_keep_the_package_one(dirs):
    from interactive_parallel.runtime.api import checked_spec
    from interactive_parallel.runtime.model.tokenizer import get_tokenizer, tokenizer_for

    spec = checked_spec(resolve_model(str(dirs["model"])))
    tok = tokenizer_for(spec)
    assert len(tok) == TOKENS and tok is tokenizer_for(resolve_model(str(dirs["model"])))  # once per directory
    assert tok.eos_token == "</s>" and tok.pad_token == "</s>"  # it ships no pad token: eos pads
    assert tokenizer_for(resolve_model("tiny-llama")) is get_tokenizer()
    assert tokenizer_for(checked_spec(resolve_model(str(dirs["bare"])))) is get_tokenizer()


@pytest.mark.rank1
def test_an_embedding_smaller_than_the_tokenizer_is_refused(dirs):
    from interactive_parallel.runtime.api import checked_spec

    with pytest.raises(UnknownModelError) as e:
        checked_spec(resolve_model(str(dirs["small"])))
    assert f"has {TOKENS} tokens" in str(e.value) and "vocab_size(256)" in str(e.value)
    assert "ids 256..299" in str(e.value)


@pytest.mark.rank1
def test_batches_and_generate_speak_the_directory_tokenizer(dirs, tmp_path):
    import torch

    from interactive_parallel import Plan
    from interactive_parallel.runtime.api import checked_spec
    from interactive_parallel.runtime.inference.generate import generate, generate_ids
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.model.tokenizer import get_tokenizer, tokenizer_for
    from interactive_parallel.runtime.training import data
    from interactive_parallel.runtime.training.train import local_batch

    spec = checked_spec(resolve_model(str(dirs["model"])))
    tok = tokenizer_for(spec)
    par = parallelize(spec, Plan(batch_size=4, seq_len=31))
    path = text_file(tmp_path, lines=40)
    source = checks.check_data(str(path))
    with data.reading(source):
        batch = local_batch(par, 2)
    flat = tok(path.read_text())["input_ids"]
    assert batch.shape == (4, 32) and int(batch.max()) >= 100  # ids only this tokenizer makes
    for row in batch.tolist():
        assert any(flat[i:i + 32] == row for i in range(0, len(flat), 32))  # packed from its ids
    synthetic = local_batch(par, 2)  # no text: the additions, in its ids
    assert set(tok.decode(synthetic[0].tolist())) <= set("0123456789+=\n")
    assert not torch.equal(synthetic, data.global_batch(par.plan.seed, 2, 4, 31))
    pieces: list[list[str]] = [[]]

    def on_step(position, new, done, step):
        pieces[0].append(new[0])
        return False

    text = generate(par, ["the quick brown"], 6)[0]
    ids = generate_ids(par, ["the quick brown"], 6)[0].tolist()
    ids = ids[:ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids
    assert text == tok.decode(ids, skip_special_tokens=True) != get_tokenizer().decode(ids, skip_special_tokens=True)
    streamed = generate(par, ["the quick brown"], 6, on_step=on_step)[0]
    assert text == streamed and "".join(pieces[0]) == text


@pytest.mark.rank1
def test_a_character_split_over_tokens_streams_once_complete(dirs):
    from interactive_parallel.runtime.api import checked_spec
    from interactive_parallel.runtime.model.tokenizer import text_added, tokenizer_for

    tok = tokenizer_for(checked_spec(resolve_model(str(dirs["model"]))))
    ids = tok("naïve café ☕ box")["input_ids"]
    assert "".join(text_added(tok, ids[:i + 1]) for i in range(len(ids))) == "naïve café ☕ box"


# ---- a live session -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s():
    from conftest import live_session

    with live_session(2) as session:
        yield session


@pytest.mark.session
def test_a_session_generates_trains_and_verifies_on_its_own_tokenizer_and_text(s, dirs, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from interactive_parallel import Plan

    tok = bpe_tokenizer()
    s.load_model(str(dirs["model"]))
    s.apply(Plan(dp=2))
    prompts = ["the quick brown", "seven wizards"]
    streamed: dict[int, str] = {}
    texts = s.generate(prompts, max_new_tokens=6, on_token=lambda r: streamed.__setitem__(
        r.prompt, streamed.get(r.prompt, "") + r.text))
    ref = AutoModelForCausalLM.from_pretrained(str(dirs["model"]), dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        out = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id,
                           suppress_tokens=list(range(TOKENS, 320)))
        assert texts[i] == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), prompt
        assert streamed[i].startswith(texts[i])

    path = text_file(tmp_path, lines=80)
    steps = s.train(2, data=str(path), batch_size=4, seq_len=31)
    assert sorted((r.step, r.rank) for r in steps) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r.tokens == 2 * 31 and r.loss == r.loss for r in steps)  # each rank its 2 rows
    assert s.model.data == checks.check_data(str(path))  # kept for verify and later calls
    report = s.verify()
    assert report.ok, report

    plan, history = s.plan, len(s.history)
    short = tmp_path / "short.txt"
    short.write_text("the fox\n")
    with pytest.raises(DataError, match=r"tokens under model's tokenizer, and batch_size\(4\) x \(seq_len\(31\) "):
        s.train(1, data=str(short))
    with pytest.raises(DataError, match="no such file"):
        s.train(1, data=str(tmp_path / "gone.txt"), batch_size=8)
    assert s.plan == plan and len(s.history) == history and s.model.data == checks.check_data(str(path))
