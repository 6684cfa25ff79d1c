"""Which tokenizer a model uses, and the package's own: one token per character, no download.

Owns the package's vocabulary (4 specials + printable ASCII + newline) and its wrapping as
a transformers PreTrainedTokenizerFast, the default for presets and for configs and model
directories that bring no tokenizer; `tokenizer_for(spec)`, the one way every rank-side
user (training batches, generate, serve) finds a model's tokenizer: a local model
directory holding one (tokenizer.json / tokenizer_config.json) has it loaded by
transformers from that directory, once per directory and process; the refusal of a
tokenizer the model cannot take (more tokens than its embedding has rows, no
end-of-sequence token); and the text a decoded token adds to what came before it.
Knows nothing of ranks, layouts or what the text is for.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Sequence

from ...plan import ModelSpec, UnknownModelError

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = tuple(chr(i) for i in range(32, 127)) + ("\n",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""Either of these in a model directory: the model brings its own tokenizer."""


@lru_cache(maxsize=1)
def get_tokenizer():
    """The package's tokenizer (what tokenizer_for gives a model that brings none)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # One token per character: a regex that matches any single character (newline included).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", padding_side="left")


def tokenizer_dir(spec: ModelSpec) -> str | None:
    """The model directory whose own tokenizer `spec` uses; None: the package's."""
    src = spec.source
    if src and any(os.path.isfile(os.path.join(src, name)) for name in TOKENIZER_FILES):
        return src
    return None


def tokenizer_for(spec: ModelSpec):
    """The tokenizer of `spec`'s model: its directory's own, else the package's."""
    directory = tokenizer_dir(spec)
    return get_tokenizer() if directory is None else _load(directory)


@lru_cache(maxsize=8)
def _load(directory: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 (whatever transformers raises, the model is refused with it)
        raise UnknownModelError(f"the tokenizer in {directory} does not load: {type(exc).__name__}: "
                                f"{str(exc)[:300]}") from None
    if tok.pad_token is None and tok.eos_token is not None:
        # Most causal LMs ship no padding token. Decoding left-pads a batch of prompts and masks
        # the padding out, so any id serves: the end-of-sequence token, as transformers' own
        # generate does.
        tok.pad_token = tok.eos_token
    return tok


def problems(spec: ModelSpec) -> list[str]:
    """Why `spec`'s model cannot take its tokenizer (empty: it can). Loads the tokenizer."""
    tok = tokenizer_for(spec)
    where = f"the tokenizer in {tokenizer_dir(spec)}" if tokenizer_dir(spec) else "the package's tokenizer"
    out = []
    if len(tok) > spec.vocab_size:
        out.append(f"{where} has {len(tok)} tokens but {spec.name}'s embedding has vocab_size({spec.vocab_size}) "
                   f"rows: ids {spec.vocab_size}..{len(tok) - 1} would have none")
    if tok.eos_token_id is None:
        out.append(f"{where} has no end-of-sequence token: documents cannot be separated nor decoding "
                   "stopped (set eos_token in its tokenizer_config.json)")
    return out


def check(spec: ModelSpec) -> ModelSpec:
    """`spec`, or UnknownModelError naming every reason its model cannot take its tokenizer."""
    found = problems(spec)
    if found:
        raise UnknownModelError(f"{spec.name}: " + "; ".join(found))
    return spec


def one_per_character(tok) -> bool:
    """The package's tokenizer: a token's text does not depend on its neighbours."""
    return tok is get_tokenizer()


@lru_cache(maxsize=None)
def piece(token: int) -> str:
    """The text one token of the package's tokenizer adds ('' for the specials). A
    tokenizer.decode call is a noticeable share of a small model's decoding step, hence the cache."""
    return get_tokenizer().decode([token], skip_special_tokens=True)


def text_added(tok, ids: Sequence[int], final: bool = False) -> str:
    """The text the last of `ids` (a row's new tokens so far) adds to the text of the others.

    The package's tokenizer: that token's own text. Any other: the row decoded with and
    without it, since a token's text may depend on its neighbours (a sentencepiece word's
    leading space, a byte-level BPE's character split over two tokens); a character still
    incomplete (decoded as U+FFFD) is held back until the token that completes it, or until
    the row's last token (`final`), so the pieces of a row join to its decoded text.
    """
    if one_per_character(tok):
        return piece(int(ids[-1]))
    before = tok.decode(list(ids[:-1]), skip_special_tokens=True).rstrip("\ufffd")
    after = tok.decode(list(ids), skip_special_tokens=True)
    after = after if final else after.rstrip("\ufffd")
    return after[len(before):] if after.startswith(before) else after[len(os.path.commonprefix([before, after])):]
