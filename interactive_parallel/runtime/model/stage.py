"""The stage module: a thin nn.Module over a transformers model's own embeddings, some of its
decoder layers and its head, run the way the model's own forward runs them.

Owns that forward (embeddings scaled and positioned as the family does, the causal mask with
padding, sliding windows and a cache's past, the rotary tables per layer type, the head's
divisor and soft-cap) over submodules found through the family's facts (plan.facts.FamilyInfo):
the model code is not edited and parameter names stay the model's. One module, shared by
whoever runs part or all of the model: a pipeline stage (runtime.parallel.pp), the whole model
under context parallel (runtime.layout.parallelize) and KV-cached decoding
(runtime.inference.decode), and the family check that compares it with the model's own logits
(runtime.model.families). Knows nothing of meshes, process groups or schedules.
"""
from __future__ import annotations

import torch
from torch import nn

from ...plan import ModelSpec


def causal_mask(attention_mask: torch.Tensor | None, seq: int, dtype, device, past: int = 0,
                window: int | None = None) -> torch.Tensor | None:
    """Additive (batch, 1, seq, past + seq) mask: causal (query i sees keys up to past + i, and
    with a sliding `window` only the last `window` of them, itself included) and hiding padding;
    None means plain causal over the queries alone (no cache, no padding, no window).

    Additive with the dtype's minimum, not -inf: a padding query that may see nothing then
    gets a uniform (finite) row instead of NaN, which would reach the real rows through V.
    """
    slides = window is not None and past + seq > window
    if past == 0 and not slides and (attention_mask is None or bool(attention_mask.all())):
        return None
    keep = torch.ones(seq, past + seq, dtype=torch.bool, device=device).tril(past)  # [s, past + s]
    if slides:
        keep &= ~torch.ones_like(keep).tril(past - window)  # keys at least `window` behind the query
    if attention_mask is not None:
        keep = keep[None, None] & attention_mask[:, None, None, :].bool()  # [b, 1, s, past + s]
    else:
        keep = keep[None, None]
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)


class StageModule(nn.Module):
    """Embeddings (first stage) -> some decoder layers -> norm and LM head (last stage).

    Holds the transformers model's own submodules, found through the family's entry in
    plan.models.FAMILIES, so their parameters keep their names relative to the model
    (`owned_prefixes` lists them). With first and last set and all layers it is the whole
    model, which context parallel uses as its forward.
    """

    def __init__(self, raw: nn.Module, spec: ModelSpec, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        fam = spec.family_info

        def part(path: str | None, held: bool = True) -> nn.Module | None:
            return raw.get_submodule(path) if path and held else None

        self.first, self.last = first, last
        self.stage_index = 0  # the global stage (apply_pp sets it); 0 for the whole model
        self.hidden_size, self.vocab_size = spec.hidden_size, spec.vocab_size
        self.embedding_scale = (spec.hidden_size ** 0.5 if fam.embedding_scale == "sqrt_hidden"
                                else float(spec.config[fam.embedding_scale]) if fam.embedding_scale else None)
        self.logit_softcap = float(spec.config[fam.logit_softcap]) if fam.logit_softcap else None
        self.logit_divisor = float(spec.config[fam.logit_divisor]) if fam.logit_divisor else None
        self.windows = [fam.layer_windows[i] if fam.layer_windows else None for i in layer_ids]
        self.rotary_types = [fam.layer_types[i] for i in layer_ids] if fam.layer_types else []
        self.layer_ids = list(layer_ids)
        all_layers = raw.get_submodule(fam.layers_path)
        self.layers = nn.ModuleList([all_layers[i] for i in layer_ids])
        self.embed = part(fam.embedding_path, first)
        self.pos_embed = part(fam.position_embedding_path, first)
        self.embed_drop = part(fam.embedding_dropout_path, first)
        # A rotary table is a constant buffer every stage needs; it is cheap to share.
        self.rotary = part(fam.rotary_path)
        self.norm = part(fam.final_norm_path, last)
        self.head = part(fam.lm_head_path, last)
        self.owned_prefixes = [f"{fam.layers_path}.{i}." for i in layer_ids]
        self.owned_prefixes += [p + "." for p in fam.embed_paths] if first else []
        self.owned_prefixes += [p + "." for p in fam.head_paths] if last else []

    def _embed(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # [b, s] -> [b, s, h]
        if self.embedding_scale is not None:
            # In the embeddings' dtype, as the model's forward does (Gemma's normalizer)
            h = h * torch.tensor(self.embedding_scale, dtype=h.dtype)
        if self.pos_embed is not None:
            h = h + self.pos_embed(position_ids)  # [1 or b, s, h] broadcast over the batch
        return self.embed_drop(h) if self.embed_drop is not None else h

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(h))  # [b, s, h] -> [b, s, vocab]
        if self.logit_divisor is not None:
            logits = logits / self.logit_divisor
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """`cache`: a transformers Cache holding (at least) this stage's layers, by their global
        index; `attention_mask` then covers the cached tokens too, [b, past + s]."""
        seq = x.shape[1]
        past = cache.get_seq_length(self.layer_ids[0]) if cache is not None else 0
        if position_ids is None:
            position_ids = (past + torch.arange(seq, device=x.device)).unsqueeze(0)  # [1, s]
        h = self._embed(x, position_ids) if self.first else x  # [b, s, h]
        masks = {w: causal_mask(attention_mask, seq, h.dtype, h.device, past, w)  # None or [b, 1, s, past + s]
                 for w in set(self.windows)}
        kw = {} if cache is None else dict(cache=cache)
        tables: dict = {}
        if self.rotary is not None:
            kw.update(position_ids=position_ids)
            for kind in set(self.rotary_types) or [None]:  # one table, or one per layer type (Gemma 3)
                extra = {} if kind is None else dict(layer_type=kind)
                tables[kind] = self.rotary(h, position_ids=position_ids, **extra)
        for i, layer in enumerate(self.layers):
            if tables:
                kw["position_embeddings"] = tables[self.rotary_types[i] if self.rotary_types else None]
            h = layer(h, attention_mask=masks[self.windows[i]], **kw)  # [b, s, h]
        if self.last:
            h = self._head(h)  # [b, s, h] -> [b, s, vocab]
        return h
