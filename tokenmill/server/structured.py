"""Structured output on the wire: the request fields that constrain what the model writes.

    response_format      OpenAI: {"type": "text" | "json_object" | "json_schema",
                         "json_schema": {"name", "schema", "strict", "description"}}
    guided_json, guided_regex, guided_choice, guided_grammar
                         vLLM's older names, kept so its clients work unchanged
    structured_outputs   vLLM's newer {"json" | "regex" | "choice" | "grammar" | "json_object"}

`constraint(body)` turns whichever one a request uses into SamplingParams keywords
(json_schema, regex, choice, grammar) and names the field it came from, so a
schema the grammar engine refuses is a 400 whose `param` is that field. Sending
two is refused rather than one silently winning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tokenmill.checks import ParamError
from tokenmill.server.text import StrictModel, Text

JSON_OBJECT = {"type": "object"}  # json_object: any JSON object


class JSONSchemaFormat(StrictModel):
    name: Text
    description: Text | None = None
    # `schema` and `json` would shadow BaseModel methods: stored under other names
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


# request field -> SamplingParams field
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def constraint(body: Any) -> tuple[str, dict[str, Any]] | None:
    """(request field, SamplingParams keywords) for the request's constraint, or None.

    body has the fields above. Raises ParamError naming the field on a bad combination."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt: ResponseFormat | None = body.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", {"json_schema": JSON_OBJECT}))
        elif fmt.json_schema is None:
            raise ParamError(
                "response_format.json_schema is required when type is 'json_schema'",
                "response_format",
            )
        else:
            schema = fmt.json_schema.schema_
            found.append(("response_format", {"json_schema": True if schema is None else schema}))
    elif fmt is not None and fmt.json_schema is not None:
        raise ParamError(
            f"response_format.json_schema needs type 'json_schema', not '{fmt.type}'",
            "response_format",
        )
    for name, kind in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, {kind: value}))
    outputs: StructuredOutputs | None = body.structured_outputs
    if outputs is not None:
        given = {
            "json_schema": outputs.json_,
            "regex": outputs.regex,
            "choice": outputs.choice,
            "grammar": outputs.grammar,
        }
        if outputs.json_object:
            given["json_object"] = JSON_OBJECT
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) != 1:
            raise ParamError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) or 'none'}",
                "structured_outputs",
            )
        kind, value = next(iter(given.items()))
        found.append(
            ("structured_outputs", {"json_schema" if kind == "json_object" else kind: value})
        )
    if len(found) > 1:
        raise ParamError(
            f"{found[0][0]} and {found[1][0]} cannot be combined: send one", found[0][0]
        )
    return found[0] if found else None
