"""Request fields for structured output (completions and chat), with OpenAI's and vLLM's names:

- `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}} (OpenAI);
- `structured_outputs`: {"json" | "json_object" | "regex" | "choice" | "grammar": ...,
  "disable_any_whitespace"} (vLLM);
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's older names).

At most one of them may be set. They become `SamplingParams.structured_outputs`; the engine
compiles the constraint and refuses (400) what it cannot enforce. vLLM options this server
does not implement are refused here by name, never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxserve.sampling_params import StructuredOutputsParams

# guided_decoding_backend values that name the engine this server uses
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "structural_tag":
            raise ValueError("response_format type 'structural_tag' is not supported; use json_schema, "
                             "json_object or structured_outputs.")
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema (the JSON schema).")
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` object."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # there is no fallback engine: nothing to disable
    # vLLM options not implemented here: refused
    structural_tag: Any = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputsRequest:
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None:
                raise ValueError(f"structured_outputs.{name} is not supported by this server.")
        if self.disable_additional_properties:
            raise ValueError("structured_outputs.disable_additional_properties is not supported; set "
                             "\"additionalProperties\": false in the schema instead.")
        return self


class StructuredOutputFields(BaseModel):
    """The structured-output fields a completions or chat request carries (mixed in)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _check_structured(self) -> StructuredOutputFields:
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern is not supported by this server.")
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"guided_decoding_backend {self.guided_decoding_backend!r} is not available: this "
                             "server's grammar engine is llguidance ('guidance'); omit the field or send 'auto'.")
        given = self.structured_sources()
        if len(given) > 1:
            raise ValueError(f"set only one way of structured output; got {', '.join(given)}.")
        return self

    def structured_sources(self) -> list[str]:
        out = []
        if self.response_format is not None and self.response_format.type != "text":
            out.append("response_format")
        if self.structured_outputs is not None:
            out.append("structured_outputs")
        out += [n for n in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                if getattr(self, n) is not None]
        return out

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint as SamplingParams takes it (ValueError for a bad combination)."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf is not None and rf.type == "json_schema":
            assert rf.json_schema is not None
            return StructuredOutputsParams(json=_schema(rf.json_schema.schema_))
        if so is not None:
            return StructuredOutputsParams(json=_schema(so.json_) if so.json_ is not None else None, regex=so.regex,
                                           choice=so.choice, grammar=so.grammar, json_object=so.json_object,
                                           disable_any_whitespace=so.disable_any_whitespace)
        if self.guided_json is not None:
            return StructuredOutputsParams(json=_schema(self.guided_json))
        if self.guided_regex is not None:
            return StructuredOutputsParams(regex=self.guided_regex)
        if self.guided_choice is not None:
            return StructuredOutputsParams(choice=self.guided_choice)
        if self.guided_grammar is not None:
            return StructuredOutputsParams(grammar=self.guided_grammar)
        return None


def _schema(value: Any) -> Any:
    """JSON schema booleans are schemas too (true: anything); keep dicts and JSON text as sent."""
    if value is True:
        return {}
    if value is False:
        raise ValueError("the JSON schema false admits no value; nothing can be generated.")
    return value
