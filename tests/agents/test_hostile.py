"""Hostile tools: every one a 400 naming the field at fault, and the server goes on."""

import json

import httpx

from tools import WEATHER


def post(server, body):
    return httpx.post(server.v1 + "/chat/completions", json=body, timeout=120)


def chat(server, **extra):
    return {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


def error_param(r):
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


def test_a_schema_past_the_cap_is_refused(server):
    big = {"type": "function", "function": {"name": "big", "parameters": {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(2000)}}}}
    assert error_param(post(server, chat(server, tools=[big]))) == "tools"


def test_a_schema_that_does_not_compile_is_refused_before_anything_is_generated(server):
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}
    for choice in ["auto", "required"]:
        assert error_param(post(server, chat(server, tools=[bad], tool_choice=choice))) == "tools"
        r = post(server, chat(server, tools=[bad], tool_choice=choice, stream=True))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_thousands_of_tools_are_refused(server):
    many = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(5000)]
    assert error_param(post(server, chat(server, tools=many))) == "tools"


def test_a_tool_result_larger_than_the_context_is_refused(server):
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain " * 200_000},
    ]
    r = post(server, {"model": server.model, "messages": messages, "tools": [WEATHER], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_bad_tool_fields_name_the_field(server):
    cases = [
        (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], response_format={"type": "json_object"}), "tools"),
        (dict(messages=[{"role": "tool", "content": None}]), "messages[0].content"),
    ]
    for extra, param in cases:
        assert error_param(post(server, chat(server, **extra))) == param, extra
    # The server still answers.
    assert post(server, chat(server)).status_code == 200
