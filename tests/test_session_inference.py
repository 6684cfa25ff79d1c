"""Inference through a live Session (tiny-llama, 4 ranks, gloo): continuous batching with
staggered arrivals under plans where transformers' engine runs and where ours does, every
request's text equal to its text generated alone, continuous against static batching,
streaming, quantization with torchao (bytes, refusals, back to full precision), and bad input
refused before any rank is touched while the session keeps serving."""
from __future__ import annotations

import asyncio
import threading

import pytest

from interactive_parallel import Plan, Request, RequestRecord, ServeResult, TokenRecord
from interactive_parallel.cluster import SessionError

pytestmark = pytest.mark.session

PROMPTS = ["12+35=", "7+8=", "99+1=", "1+2+3+4+5=", "3=", "40+2=", "21+21=", "9+90=", "5+5=", "60+6="]


def staggered(n: int = 10, spacing: float = 0.03) -> list[Request]:
    return [Request(id=f"r{i}", prompt=PROMPTS[i % len(PROMPTS)], arrival=spacing * i,
                    max_new_tokens=3 + 2 * (i % 5)) for i in range(n)]


@pytest.fixture(scope="module")
def s(session4):
    session4.load_model("tiny-llama")
    return session4


def _alone(s, req: Request) -> str:
    text = s.generate([req.prompt], max_new_tokens=req.max_new_tokens)[0]
    for stop in req.stop:
        if stop in text:
            text = text[:text.index(stop) + len(stop)]
    return text


@pytest.mark.parametrize("fields, engine", [(dict(dp=2, tp=2), "transformers"), (dict(pp=2, dp=2), "ours")])
def test_served_texts_equal_each_request_generated_alone(s, fields, engine):
    s.apply(Plan(**fields))
    reqs = staggered()
    reqs[3] = Request(id="r3", prompt=reqs[3].prompt, arrival=reqs[3].arrival, max_new_tokens=12,
                      stop=[_alone(s, Request(id="x", prompt=reqs[3].prompt, max_new_tokens=12))[2:4]])
    tokens: list[TokenRecord] = []
    finished: list[RequestRecord] = []
    result = s.serve(reqs, max_batch=4, on_token=tokens.append, on_request=finished.append)
    kept = list(s.decoding())
    assert isinstance(result, ServeResult) and result.engine == engine, result.reason
    assert [r.id for r in result.requests] == [r.id for r in reqs]
    for req, rec in zip(reqs, result.requests):
        assert rec.text == _alone(s, req), (req, rec)
        assert rec.arrival <= rec.admitted <= rec.first_token <= rec.finished, rec
        streamed = "".join(t.text for t in sorted((t for t in tokens if t.prompt == reqs.index(req)),
                                                  key=lambda t: t.position))
        assert streamed.startswith(rec.text)
    assert result.requests[3].finish_reason == "stop"
    assert {r.id for r in finished} == {r.id for r in reqs}
    ranks = {st.rank for st in result.steps}
    assert ranks == {0, 1, 2, 3} and all(st.kv_bytes >= 0 for st in result.steps)
    assert max(st.kv_bytes for st in result.steps) > 0 and max(st.running for st in result.steps) > 1
    assert kept == result.steps and {st.engine for st in kept} == {engine}
    assert all(0 <= st.comm_s <= st.time_s for st in kept)
    # a second engine on the same tp groups (notebook 08's question 2 reruns its serving cell): its gloo
    # group is named apart from the first's (runtime.inference.serve_transformers._named_apart)
    again = s.serve(reqs[:2], max_batch=2)
    assert again.engine == engine and again.texts == {r.id: result.texts[r.id] for r in reqs[:2]}


def test_continuous_batching_needs_fewer_steps_than_static(s):
    s.apply(Plan(tp=2, pp=2))
    reqs = [Request(id=f"q{i}", prompt=PROMPTS[i], max_new_tokens=[2, 14, 3, 12, 4, 10, 2, 8][i]) for i in range(8)]
    cont = s.serve(reqs, max_batch=4, policy="continuous")
    static = s.serve(reqs, max_batch=4, policy="static")
    assert cont.engine == static.engine == "ours"
    assert cont.texts == static.texts
    assert cont.n_steps < static.n_steps, (cont.n_steps, static.n_steps)
    # static batching admits nobody into a running batch: with 8 requests and 4 at once, half wait
    # for the whole first batch; continuous admits each as soon as a row frees up
    first_static = sorted(r.admitted for r in static.requests)[4]
    assert first_static >= max(r.finished for r in static.requests[:4])


def test_serve_stream_yields_tokens_as_they_come_then_the_result(s):
    s.apply(Plan(dp=4))

    async def collect():
        return [item async for item in s.serve_stream(staggered(6), max_batch=2)]

    items = asyncio.run(collect())
    assert isinstance(items[-1], ServeResult) and all(isinstance(t, TokenRecord) for t in items[:-1])
    assert sum(len(t.text) for t in items[:-1]) == sum(len(r.text) for r in items[-1].requests)


def test_interrupt_ends_serving_and_the_session_keeps_serving(s):
    s.apply(Plan(dp=2, tp=2))
    reqs = [Request(id=f"long{i}", prompt=PROMPTS[i], arrival=0.2 * i, max_new_tokens=200) for i in range(8)]
    seen: list[TokenRecord] = []

    def on_token(t):
        seen.append(t)
        if len(seen) == 20:
            threading.Thread(target=s.interrupt).start()

    result = s.serve(reqs, engine="ours", on_token=on_token)
    assert len(result.requests) == len(reqs) and any(r.finish_reason == "interrupted" for r in result.requests)
    again = s.serve(staggered(2))
    assert all(r.finish_reason in ("length", "eos") for r in again.requests)


def _spy_untouched(s, monkeypatch):
    monkeypatch.setattr(s.ranks.caller, "submit", lambda *a, **k: pytest.fail("rank touched"))


def test_bad_serving_and_quantization_input_is_refused_before_any_rank_is_touched(s, monkeypatch):
    s.apply(Plan(pp=2, dp=2))
    _spy_untouched(s, monkeypatch)
    cases = [
        ([Request(id="a", prompt="")], r"request 'a': prompt must be a non-empty string"),
        ([Request(id="a", prompt="1+1=", max_new_tokens=400)], r"prompt\(4\) \+ max_new_tokens\(400\) > .*256"),
        ([Request(id="a", prompt="1=", arrival=-1.0)], r"arrival\(-1.0\) must be >= 0"),
        ([Request(id="a", prompt="1="), Request(id="a", prompt="2=")],
         r"duplicate request id 'a' \(requests 0 and 1\)"),
        ([], "no requests"),
    ]
    for reqs, message in cases:
        with pytest.raises(ValueError, match=message):
            s.serve(reqs)
    with pytest.raises(ValueError, match=r"transformers' engine cannot serve here: pp\(2\)"):
        s.serve(["1+1="], engine="transformers")
    with pytest.raises(ValueError, match="engine 'vllm' is not one of"):
        s.serve(["1+1="], engine="vllm")
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        s.quantize("int3")
    monkeypatch.undo()
    s.apply(Plan(fsdp=4))
    _spy_untouched(s, monkeypatch)
    with pytest.raises(ValueError, match=r"plan fsdp4: FSDP gathers its own fp32 shards"):
        s.quantize("int8-weight-only")
    monkeypatch.undo()
    assert s.serve(["12+3="]).requests[0].tokens >= 1  # still serving


def test_quantization_measured_refused_for_training_and_undone_by_apply_and_load(s, tmp_path):
    s.apply(Plan(dp=4))
    before = s.generate(PROMPTS[:4], max_new_tokens=8)
    s.save(str(tmp_path / "fp32"))
    records = s.quantize("int8-weight-only")
    assert len(records) == 4 and s.quantization == "int8-weight-only"
    for r in records:
        assert 0 < r.params_after < r.params_before and r.linears == 28 and r.kept_bytes > 0
        assert r.tokens_per_s_before > 0 and r.tokens_per_s_after > 0 and 0 <= r.agreement <= 1
    assert len(s.generate(PROMPTS[:4], max_new_tokens=8)) == 4
    with pytest.raises(SessionError, match=r"quantized \(int8-weight-only\): train needs full-precision"):
        s.train(steps=1)
    s.apply(Plan(dp=4))  # back to full precision
    assert s.quantization is None and s.generate(PROMPTS[:4], max_new_tokens=8) == before
    s.quantize("int8-weight-only")
    s.apply(Plan(tp=4), keep_quantization=True)
    assert s.quantization == "int8-weight-only" and {r.plan for r in s.telemetry.quantization} == {"tp4"}
    with pytest.raises(ValueError, match=r"plan tp4: int8-dynamic's int8 matmul"):
        s.quantize("int8-dynamic")
    s.dequantize()
    assert s.generate(PROMPTS[:4], max_new_tokens=8) == before
    s.quantize("int8-weight-only")
    with pytest.raises(SessionError, match="save needs full-precision"):
        s.save(str(tmp_path / "int8"))
    s.load(str(tmp_path / "fp32"), keep_quantization=True)
    assert s.quantization == "int8-weight-only"
    s.load(str(tmp_path / "fp32"))
    assert s.quantization is None and s.generate(PROMPTS[:4], max_new_tokens=8) == before
    assert len(s.train(steps=1)) == 4
