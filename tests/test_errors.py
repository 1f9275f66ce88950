"""Errors carry their parameter: a ParamError's `param` is set where it
is raised, and the server's `param`, the CLI's option and the respelled message come
from that attribute, never from reading the message.

Unit tests of ParamError and `to_api_error`, then an in-process server on a tiny
random-weight model, whose bad requests are answered with the raised error's attribute
(shown by raising errors whose message names another parameter, or none at all).
"""

from __future__ import annotations

import argparse

import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from tokenmill.checks import ParamError, check_float, check_int
from tokenmill.config import ConfigError
from tokenmill.engine.llm_engine import RequestError
from tokenmill.sampling import SamplingParams
from tokenmill.sampling.grammar import GrammarError
from tokenmill.server.async_engine import EngineFailure, QueueFull, ShuttingDown
from tokenmill.server.errors import (
    INTERNAL,
    APIError,
    InternalError,
    format_openai,
    to_api_error,
)
from tokenmill.server.protocol import make_sampling_params

CHAT = [{"role": "user", "content": "t1 t2"}]

# --------------------------------------------------------------------------- ParamError


def test_a_named_error_keeps_its_names_apart_from_its_text():
    error = ParamError.named("ignore_eos", " cannot be combined with ", "regex")
    assert str(error) == "ignore_eos cannot be combined with regex"
    assert error.param == "ignore_eos" and error.problem == "cannot be combined with regex"
    renamed = error.renamed({"regex": "guided_regex", "ignore_eos": "ignore_eos"})
    assert str(renamed) == "ignore_eos cannot be combined with guided_regex"
    assert renamed.param == "ignore_eos"


def test_renaming_touches_names_only_never_the_text_between_them():
    # the old regex renamed every word "choice" in the message, the client's quoted
    # values included
    error = ParamError.named("choice", " must be non-empty strings, got ['choice', '']")
    renamed = error.renamed({"choice": "guided_choice"})
    assert str(renamed) == "guided_choice must be non-empty strings, got ['choice', '']"
    assert renamed.param == "guided_choice"


def test_a_plain_error_has_its_param_and_no_problem():
    error = ParamError("prompt is empty", "prompt")
    assert error.param == "prompt" and error.problem is None and str(error) == "prompt is empty"
    assert error.renamed({"prompt": "messages"}).param == "messages"
    assert ParamError("about nothing").param is None
    assert isinstance(error, ValueError)


def test_an_error_about_two_parameters_names_none():
    with pytest.raises(ParamError) as caught:
        SamplingParams(regex="a", choice=["b"])
    assert caught.value.param is None and caught.value.problem is None
    assert "got regex and choice" in str(caught.value)


def test_request_error_is_a_param_error():
    error = RequestError("prompt is empty", "prompt")
    assert isinstance(error, ParamError) and error.param == "prompt"
    assert RequestError("request id 'a' is already running").param is None


def test_range_checks_name_the_parameter_and_the_item():
    with pytest.raises(ParamError) as caught:
        check_float("logit_bias", 500, -100.0, 100.0, at="[5]")
    assert str(caught.value) == "logit_bias[5] must be in [-100.0, 100.0], got 500.0"
    assert caught.value.param == "logit_bias"
    with pytest.raises(ParamError) as caught:
        check_int("n", 0, 1)
    assert caught.value.param == "n" and caught.value.problem == "must be >= 1, got 0"
    with pytest.raises(ConfigError, match=r"^rope\.dim must be in \[2, 8\], got 9$"):
        check_int("rope.dim", 9, 2, 8, error=ConfigError)  # other error types: the message


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1e-46}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 25}, "logprobs"),
        ({"seed": 2**70}, "seed"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"regex": ""}, "regex"),
        ({"regex": "a", "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_sampling_params_raise_with_their_param(kwargs, param):
    with pytest.raises(ParamError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == param


def test_the_server_respells_sampling_names_as_its_fields():
    with pytest.raises(APIError) as caught:
        make_sampling_params(renames={"logprobs": "top_logprobs"}, logprobs=30)
    assert caught.value.param == "top_logprobs"
    assert caught.value.message == "top_logprobs must be in [0, 20], got 30"
    with pytest.raises(APIError) as caught:
        make_sampling_params(renames={"regex": "guided_regex"}, regex="a", ignore_eos=True)
    assert caught.value.param == "ignore_eos"
    assert caught.value.message == "ignore_eos cannot be combined with guided_regex"


# --------------------------------------------------------------------------- to_api_error


def _fields(error: APIError) -> tuple:
    return error.status, error.type, error.message, error.param, error.code


def test_an_api_error_is_itself():
    error = APIError(404, "no such model", param="model", code="model_not_found")
    assert to_api_error(error) is error


@pytest.mark.parametrize(
    "exc, expected",
    [
        (ParamError("bad", "top_p"), (400, "invalid_request_error", "bad", "top_p", None)),
        (RequestError("too long", "prompt"), (400, "invalid_request_error", "too long", "prompt", None)),
        (RequestError("duplicate id"), (400, "invalid_request_error", "duplicate id", None, None)),
        (GrammarError("regex", "invalid regex"), (400, "invalid_request_error", "invalid regex", "regex", None)),
        (QueueFull("busy"), (429, "rate_limit_error", "busy", None, "queue_full")),
        (ShuttingDown("draining"), (503, "server_error", "draining", None, "shutting_down")),
        (EngineFailure("boom"), (500, "server_error", "boom", None, "internal_error")),
        (InternalError(), (500, "server_error", INTERNAL, None, "internal_error")),
        (KeyError("oops"), (500, "server_error", "'oops'", None, "internal_error")),
        (HTTPException(404, "Not Found"), (404, "invalid_request_error", "Not Found", None, None)),
        (RecursionError(), (400, "invalid_request_error", "the request nests too deeply to process; flatten it", None, None)),
    ],
)  # fmt: skip
def test_each_kind_of_error_has_one_mapping(exc, expected):
    assert _fields(to_api_error(exc)) == expected


def test_retry_after_on_a_full_queue_and_a_draining_server():
    assert to_api_error(QueueFull("busy")).headers == {"Retry-After": "1"}
    assert to_api_error(ShuttingDown("draining")).headers == {"Retry-After": "1"}


def test_a_route_names_the_field_it_knows_an_error_is_about():
    # a chat template's refusal is a plain ValueError, about the messages
    error = to_api_error(ValueError("the template failed"), param="messages")
    assert _fields(error) == (400, "invalid_request_error", "the template failed", "messages", None)
    # a grammar's is about the field that carried it, not its kind
    assert to_api_error(GrammarError("regex", "bad"), param="guided_regex").param == "guided_regex"
    # a plain ValueError without one is a bug here: a 500
    assert to_api_error(ValueError("oops")).status == 500


def test_an_engine_parameter_the_request_lacks_names_no_field():
    error = RequestError("prompt has 9000 tokens", "prompt")
    assert to_api_error(error, fields={"messages", "n"}).param is None
    assert to_api_error(error, fields={"prompt", "n"}).param == "prompt"
    assert to_api_error(RequestError("n is 9", "n"), fields={"messages", "n"}).param == "n"


def test_validation_errors_name_the_first_bad_field():
    exc = RequestValidationError(
        [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required", "input": {}}]
    )
    assert _fields(to_api_error(exc)) == (
        400, "invalid_request_error", "Missing required parameter: 'messages'", "messages", None
    )  # fmt: skip


def test_the_openai_shape_is_a_formatter_of_the_error():
    error = APIError(
        500, "failed at 127.0.0.1:29500\nTraceback (most recent call last):", type="server_error"
    )
    assert format_openai(error) == error.body() == {
        "error": {"message": "failed at <address>", "type": "server_error", "param": None, "code": None}
    }  # fmt: skip


# --------------------------------------------------------------------------- the CLI


def test_the_cli_names_the_option_from_the_param(monkeypatch, capsys):
    import tokenmill.cli as cli

    parser = argparse.ArgumentParser(prog="tokenmill")
    sub = parser.add_subparsers()
    generate = sub.add_parser("generate")
    generate.add_argument("--top-p")
    args = argparse.Namespace(command="generate")

    def refuse(error):
        def params(args):
            raise error

        monkeypatch.setattr(cli, "_params", params)
        with pytest.raises(SystemExit) as caught:
            cli._check_sampling_args(parser, args)
        assert caught.value.code == 2
        return capsys.readouterr().err

    # the option comes from `param`: the message's first word is another field's name
    err = refuse(ParamError.named("top_p", " is wrong, unlike temperature"))
    assert "error: argument --top-p: is wrong, unlike temperature" in err
    # no option for the param, or no param: the whole message
    assert "error: seed is wrong (see" in refuse(ParamError.named("seed", " is wrong"))
    assert "error: top_p and seed clash (see" in refuse(ParamError("top_p and seed clash"))


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def app(tiny_llama):
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.app import create_app
    from tokenmill.server.async_engine import AsyncEngine

    # a template, so that chat requests get as far as their sampling parameters
    (tiny_llama / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }} {% endfor %}"
    )
    engine = AsyncEngine(LLMEngine(tiny_llama, kv_cache_memory="512tok", threads=1))
    return create_app(engine, model_name="tiny")


@pytest.fixture(scope="module")
def http(app):
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        yield client


def _error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": "t1", "temperature": -1}, "temperature"),
        ("completions", {"prompt": "t1", "logit_bias": {"5": 500}}, "logit_bias"),
        ("completions", {"prompt": "t1", "logit_bias": {"999999": 1}}, "logit_bias"),  # engine's
        ("completions", {"prompt": "t1", "guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
        ("completions", {"prompt": "t1", "guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
        ("completions", {"prompt": [999999]}, "prompt"),
        ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ],
)  # fmt: skip
def test_bad_requests_name_their_param(http, path, body, param):
    assert _error(http.post(f"/v1/{path}", json=body))["param"] == param


def test_the_param_is_the_raised_errors_attribute(http, monkeypatch):
    """Errors whose message names another parameter, or none: the answer's param is the
    attribute, and the message is passed on as it is."""
    import tokenmill.server.protocol as protocol

    def refusing(**kwargs):
        raise ParamError.named("top_p", " refused, and so is seed")

    monkeypatch.setattr(protocol, "SamplingParams", refusing)
    error = _error(http.post("/v1/completions", json={"prompt": "t1"}))
    assert error["param"] == "top_p" and error["message"] == "top_p refused, and so is seed"
    monkeypatch.undo()

    engine = http.app.state.engine
    for raised, param in [
        (RequestError("temperature is fine; this is about the seed", "seed"), "seed"),
        (RequestError("no name here"), None),
        (RequestError("an engine-side name", "request_id"), None),  # not a request field
    ]:

        async def generate(*args, error=raised, **kwargs):
            raise error

        monkeypatch.setattr(engine, "generate", generate)
        error = _error(http.post("/v1/completions", json={"prompt": "t1", "max_tokens": 2}))
        assert error["param"] == param and error["message"] == str(raised), error


def test_engine_refusals_keep_their_status(http, monkeypatch):
    engine = http.app.state.engine
    for raised, status, code in [(QueueFull("busy"), 429, "queue_full"), (ShuttingDown("bye"), 503, "shutting_down")]:  # fmt: skip

        async def generate(*args, error=raised, **kwargs):
            raise error

        monkeypatch.setattr(engine, "generate", generate)
        response = http.post("/v1/completions", json={"prompt": "t1", "max_tokens": 2})
        assert _error(response, status)["code"] == code
        assert response.headers["retry-after"] == "1"
