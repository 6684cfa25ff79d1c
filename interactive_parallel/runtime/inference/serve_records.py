"""A served request's record as it grows, shared by both serving engines (runtime.inference.serve's
scheduler and runtime.inference.serve_transformers' driver of transformers' engine).

Owns opening a RequestRecord, folding each new token into it (its text, its count and, once
it ends, why) and marking what the call left unfinished. Knows nothing of batching, caches
or which engine runs: each engine calls these as its tokens arrive.
"""
from __future__ import annotations

from typing import Iterable

from ...records import Request, RequestRecord
from ..model.tokenizer import text_added


def new_record(req: Request, rank: int, engine: str) -> RequestRecord:
    return RequestRecord(id=req.id, rank=rank, prompt=req.prompt, arrival=req.arrival, engine=engine)


def add_token(rec: RequestRecord, req: Request, ids: list[int], tok) -> str:
    """Fold the request's newest token, the last of `ids` (its new tokens so far, under the
    model's tokenizer `tok`), into its record (its text, count and, once it ends, why: end
    of sequence, a stop string, which is kept and ends the text, or max_new_tokens); the
    text the token added."""
    token, eos = ids[-1], tok.eos_token_id
    added = text_added(tok, ids, final=token == eos or rec.tokens + 1 >= req.max_new_tokens)
    rec.text += added
    rec.tokens += 1
    hit = [(rec.text.find(s), s) for s in req.stop if s in rec.text]
    if token == eos:
        rec.finish_reason = "eos"
    elif hit:
        at, stop = min(hit)
        rec.text, rec.finish_reason = rec.text[:at + len(stop)], "stop"
    elif rec.tokens >= req.max_new_tokens:
        rec.finish_reason = "length"
    return added


def close_records(records: Iterable[RequestRecord]) -> None:
    """Requests that had not finished when the call ended were interrupted."""
    for rec in records:
        if rec.finished < 0:
            rec.finish_reason = "interrupted"
