"""vLLM's server forms on the session's live server (the default model): `use_beam_search`
with `n` as the beam width on both generation routes (plain, streamed, with log-probs), the
completions prompt forms read by the one normaliser, and /sleep right after a request."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL

PROMPT = "The capital of France is"


def _completions(http, **body):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_beam_search_of_width_one_is_the_greedy_completion(http):
    greedy = _completions(http, temperature=0)["choices"][0]["text"]
    beam = _completions(http, use_beam_search=True, n=1, temperature=0)["choices"]
    assert [c["text"] for c in beam] == [greedy]


def test_beam_search_returns_n_beams_best_first(http):
    body = _completions(http, use_beam_search=True, n=3, temperature=0, logprobs=1, echo=False)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 3
    prompt_len = body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in choices)
    # ranked by cumulative log-prob over the whole length (length_penalty 1; no EOS at 4 tokens here)
    scores = [sum(c["logprobs"]["token_logprobs"]) / (prompt_len + len(c["logprobs"]["tokens"])) for c in choices]
    assert scores == sorted(scores, reverse=True)
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    assert all(len(top) <= 2 for c in choices for top in c["logprobs"]["top_logprobs"])  # the chosen + 1


def test_beam_search_streams_and_serves_chat(http, client):
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 2,
                                                      "use_beam_search": True, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    plain = _completions(http, max_tokens=3, n=2, use_beam_search=True)["choices"]
    assert texts == {c["index"]: c["text"] for c in plain}
    assert events[-1]["usage"]["completion_tokens"] > 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          n=2, extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content


@pytest.mark.parametrize("extra, param", [({"stop": ["x"]}, "stop"), ({"top_p": 0.5}, "top_p"),
                                          ({"response_format": {"type": "json_object"}}, "response_format"),
                                          ({"n": 11}, "max-logprobs")])
def test_what_beam_search_cannot_honour_is_a_400(http, extra, param):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "use_beam_search": True,
                                           **extra})
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"] + str(r.json()["error"]["param"])


def test_completion_prompt_forms_agree(http):
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    text = _completions(http, temperature=0)["choices"][0]["text"]
    assert _completions(http, prompt=ids, temperature=0)["choices"][0]["text"] == text
    batch = _completions(http, prompt=[ids, ids], temperature=0)["choices"]
    assert [c["text"] for c in batch] == [text, text]
    assert [c["text"] for c in _completions(http, prompt=[PROMPT], temperature=0)["choices"]] == [text]


def test_sleep_right_after_a_request_finished(http):
    """A request's runner slot is released by the next step; /sleep must not wait for one (409)."""
    _completions(http, max_tokens=1)
    assert http.post("/sleep").status_code == 200
    assert http.get("/is_sleeping").json()["is_sleeping"]
    assert http.post("/wake_up").status_code == 200
    assert _completions(http, max_tokens=1)["choices"][0]["finish_reason"] == "length"
