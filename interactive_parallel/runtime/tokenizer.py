"""The package's own tokenizer: one token per character, no download.

Owns the vocabulary (4 specials + printable ASCII + newline) and its wrapping as a
transformers PreTrainedTokenizerFast. Knows nothing of models or ranks.
"""
from __future__ import annotations

from functools import lru_cache

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = tuple(chr(i) for i in range(32, 127)) + ("\n",)


@lru_cache(maxsize=1)
def get_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # One token per character: a regex that matches any single character (newline included).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", padding_side="left")
