"""The server's input boundary without a server: property tests of the body parser and the
protocol models (pure Python, no model). Whatever a client sends is a value or a 4xx in
OpenAI's error envelope, never another exception. The live server's side is test_fuzz.py."""

from __future__ import annotations

import contextlib
import copy
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.server.body import MAX_JSON_DEPTH, parse_json
from jaxserve.server.errors import APIError, error_response, quote
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.protocol_chat import ChatCompletionRequest
from jaxserve.server.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from tests.server.bad_input import (
    CHAT,
    FLOAT_FIELDS,
    PROMPT,
    Raw,
    deep_dict,
    deep_list,
    dumps,
    field_values,
    nasty,
    numbers,
)
from tests.server.conftest import MODEL



# ---------------------------------------------------------------------------- the body parser
@settings(max_examples=400, derandomize=True, deadline=None, database=None)
@given(value=nasty)
def test_parse_json_answers_4xx_or_a_value(value: Any) -> None:
    # strings escaped ("\\ud800"), and as raw UTF-8 bytes (a lone surrogate as ED A0 80)
    for body in (dumps(value).encode(), dumps(value, ascii=False).encode("utf-8", "surrogatepass")):
        try:
            parse_json(body)
        except APIError as e:
            assert e.status == 400 and e.message


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(body=st.binary(max_size=64))
def test_parse_json_on_random_bytes(body: bytes) -> None:
    try:
        parse_json(body)
    except APIError as e:
        assert e.status == 400


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 990, 5000, 100_000])
def test_parse_json_refuses_deep_nesting(depth: int) -> None:
    for raw in (deep_list(depth), deep_dict(depth), Raw('{"extra": ' + deep_list(depth).text + "}")):
        with pytest.raises(APIError, match="nested more than") as ei:
            parse_json(raw.text.encode())
        assert ei.value.status == 400
    assert parse_json(deep_list(MAX_JSON_DEPTH).text.encode())  # the limit itself is fine


def test_parse_json_names_the_field_of_a_surrogate() -> None:
    for body in (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
                 b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}'):  # escaped; raw bytes
        with pytest.raises(APIError, match="surrogate") as ei:
            parse_json(body)
        assert ei.value.param == "messages"
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}  # a pair is fine


def test_error_bodies_always_encode() -> None:
    """A message quoting client text with a lone surrogate still renders (as a backslash escape)."""
    r = error_response(404, "The model '\ud800' does not exist.", param="mo\udc00del")
    err = json.loads(r.body)["error"]
    assert err["message"] == "The model '\\ud800' does not exist." and err["param"] == "mo\\udc00del"
    assert quote("x" * 1000).endswith("...") and len(quote("x" * 1000)) == 100


# ---------------------------------------------------------------------------- the protocol models
BASES: dict[type, dict[str, Any]] = {
    CompletionRequest: {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0},
    ChatCompletionRequest: {"model": MODEL, "messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 2},
    TokenizeRequest: {"model": MODEL, "messages": CHAT},
    DetokenizeRequest: {"tokens": [1, 2, 3]},
}


def _python(value: Any) -> Any:
    """The value json.loads would give for a generated one (Raw fragments parsed)."""
    if isinstance(value, Raw):
        try:
            return parse_json(b'{"v": ' + value.text.encode() + b"}")["v"]
        except APIError:
            return None
    if isinstance(value, dict):
        return {str(k): _python(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_python(v) for v in value]
    return value


@st.composite
def model_inputs(draw: st.DrawFn) -> tuple[type, dict[str, Any]]:
    model = draw(st.sampled_from(list(BASES)))
    data = copy.deepcopy(BASES[model])
    fields = sorted(model.model_fields) + ["unknown_extra"]
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(fields))
        if draw(st.integers(0, 9)) == 0:
            data.pop(field, None)
        else:
            data[field] = _python(draw(field_values))
    return model, data


def _floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [x for v in value for x in _floats(v)] if isinstance(value, list) else []


FREE_FORM = frozenset({"chat_template_kwargs", "guided_json", "json_", "schema_", "parameters"})


def _declared(value: Any, skip: frozenset[str] = FREE_FORM) -> Any:
    """A request model's declared fields, recursively, less the free-form JSON ones (template
    arguments, JSON schemas: the grammar compiler refuses what is not JSON). Unknown fields
    are kept only to be listed (X-Ignored-Fields), never used, so their values may be anything
    JSON holds."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return {k: _declared(getattr(value, k)) for k in type(value).model_fields if k not in skip}
    if isinstance(value, list):
        return [_declared(v) for v in value]
    return value


@settings(max_examples=1500, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=model_inputs())
def test_protocol_models_raise_only_validation_errors(case: tuple[type, dict[str, Any]]) -> None:
    model, data = case
    try:
        request = model.model_validate(data)
    except ValueError:  # pydantic's ValidationError is a ValueError: a 400
        return
    # every number a request model accepted is finite (free-form JSON aside)
    assert all(math.isfinite(x) for x in _floats(_declared(request))), request
    if hasattr(request, "to_sampling_params"):
        with contextlib.suppress(ValueError):  # a 400 as well
            request.to_sampling_params().validate()


FLOAT_SLOTS = [*((CompletionRequest, f) for f in FLOAT_FIELDS), (CompletionRequest, "logit_bias"),
               (ChatCompletionRequest, "temperature"), (ChatCompletionRequest, "logit_bias")]


@settings(max_examples=600, derandomize=True, deadline=None, database=None)
@given(slot=st.sampled_from(FLOAT_SLOTS), value=numbers)
def test_every_float_field_is_finite_or_refused(slot: tuple[type, str], value: float) -> None:
    model, field = slot
    data = {**BASES[model], field: {"30": value} if field == "logit_bias" else value}
    try:
        request = model.model_validate(data)
    except ValueError as e:
        assert math.isfinite(value) or "finite number" in str(e)
        return
    assert all(math.isfinite(x) for x in _floats(_declared(request, frozenset()))), request
    params = request.to_sampling_params()
    assert all(math.isfinite(x) for x in (params.temperature, params.repetition_penalty,
                                          *(params.logit_bias or {}).values()))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", FLOAT_FIELDS + ["logit_bias"])
def test_protocol_models_refuse_non_finite_floats(field: str, value: float) -> None:
    data = {"prompt": PROMPT, field: {"30": value} if field == "logit_bias" else value}
    with pytest.raises(ValueError, match="finite"):
        CompletionRequest.model_validate(data)
