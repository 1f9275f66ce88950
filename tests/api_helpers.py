"""Request pieces the API test modules share: a closed JSON Schema object, the get_weather
tool in OpenAI's chat form, and the assistant turn of one call as a chat history spells it.

Each returns a fresh dict, its keys in the order the tests' literals had them, since a
test may look for json.dumps of one inside a rendered prompt."""

from __future__ import annotations

from typing import Any


def closed_object(properties: dict[str, dict]) -> dict:
    """A JSON Schema object of these properties, all required, nothing else allowed:
    {"type": "object", "properties", "required": [names in order], "additionalProperties": False}.
    """
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def weather_tool(description: str, city_max_length: int, unit: bool = True) -> dict:
    """get_weather in OpenAI's chat form, {"type": "function", "function": {name,
    description, parameters}}: a city of at most city_max_length characters and, with
    unit, "celsius" or "fahrenheit"; every parameter required."""
    properties: dict[str, dict] = {"city": {"type": "string", "maxLength": city_max_length}}
    if unit:
        properties["unit"] = {"enum": ["celsius", "fahrenheit"]}
    return {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": description,
            "parameters": closed_object(properties),
        },
    }


def call_turn(call_id: str, name: str, arguments: Any, content: str | None = None) -> dict:
    """An OpenAI chat assistant turn that makes one function call: {"role": "assistant",
    "content", "tool_calls": [{"id", "type": "function", "function": {name, arguments}}]};
    arguments as the caller sends them (a JSON string, or a dict for a template's input)."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def tool_turn(call_id: str, content: str) -> dict:
    """An OpenAI chat tool turn: the result of the call call_id."""
    return {"role": "tool", "tool_call_id": call_id, "content": content}
