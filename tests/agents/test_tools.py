"""Tool calls through the unmodified `openai` client: auto, required and a named function, each
call fed back as a tool result, streamed and not; every call of over 30 schemas parses and
validates, on the CPU path and on the device."""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from openai import OpenAI

from tools import CASES, TIME, WEATHER


def client(server):
    return OpenAI(base_url=server.v1, api_key="none", timeout=600)


def schema_of(tools, name):
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def check_calls(calls, tools):
    """Every call names a tool and its arguments validate against its parameters."""
    assert calls, "no call"
    for call in calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schema_of(tools, call.function.name))


def streamed(stream):
    """A streamed reply as (content, calls by index as dicts, finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            if tc.function:
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_a_required_call_parses_validates_and_its_result_goes_back_to_the_model(server):
    c = client(server)
    tools = [WEATHER, TIME]
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    r = c.chat.completions.create(model=server.model, messages=messages, tools=tools, tool_choice="required", temperature=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_calls(choice.message.tool_calls, tools)
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    messages.append(choice.message.model_dump(exclude_none=True))
    result = json.dumps({"temperature_celsius": 18, "sky": "cloudy"})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    again = c.chat.completions.create(model=server.model, messages=messages, tools=tools, temperature=0, max_tokens=80)
    # The call and its result are in the prompt (the template's <tool_call> and <tool_response>).
    assert again.usage.prompt_tokens >= r.usage.prompt_tokens + r.usage.completion_tokens + 10
    # This 0.5B model, given the result, tends to call again (a 1.5B answers: see below); either
    # way its reply is well formed.
    choice = again.choices[0]
    if choice.finish_reason == "tool_calls":
        check_calls(choice.message.tool_calls, tools)
    else:
        assert choice.finish_reason == "stop" and choice.message.content


CITY_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Get the current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}
ANSWER_FROM_TOOLS = "You are a helpful assistant. When a tool returns a result, answer the user with it in plain words."


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_result_fed_back_is_the_answer(big_server, stream):
    """Qwen2.5-Coder-1.5B-Instruct answers from the result of the call it made."""
    c = client(big_server)
    tools = [CITY_WEATHER]
    messages = [{"role": "system", "content": ANSWER_FROM_TOOLS}, {"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=big_server.model, messages=messages, tools=tools, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, tools)
    call = r.choices[0].message.tool_calls[0]
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, cloudy"})
    if stream:
        text, calls, finish = streamed(c.chat.completions.create(model=big_server.model, messages=messages, tools=tools, temperature=0, max_tokens=60, stream=True))
    else:
        answer = c.chat.completions.create(model=big_server.model, messages=messages, tools=tools, temperature=0, max_tokens=60)
        text, calls, finish = answer.choices[0].message.content, answer.choices[0].message.tool_calls, answer.choices[0].finish_reason
    assert finish == "stop" and not calls and "18" in text, (text, calls, finish)


def test_a_named_function_is_the_one_called(server):
    c = client(server)
    tools = [WEATHER, TIME]
    r = c.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=120,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, tools)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_time"]


def test_auto_calls_when_the_model_opens_a_call_and_answers_when_it_does_not(server):
    c = client(server)
    tools = [WEATHER, TIME]
    r = c.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Use a tool to find the current time in Tokyo."}],
        tools=tools,
        temperature=0,
        max_tokens=120,
    )
    assert r.choices[0].finish_reason == "tool_calls", r
    check_calls(r.choices[0].message.tool_calls, tools)
    # With none the tools are shown but no call is made.
    r = c.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Use a tool to find the current time in Tokyo."}],
        tools=tools,
        tool_choice="none",
        temperature=0,
        max_tokens=30,
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_calls_arrive_as_tool_call_deltas(server, choice):
    c = client(server)
    tools = [WEATHER, TIME]
    stream = c.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Use a tool to get the weather in Oslo."}],
        tools=tools,
        tool_choice=choice,
        temperature=0,
        max_tokens=120,
        stream=True,
    )
    content, calls, finish = streamed(stream)
    assert finish == "tool_calls" and calls, (content, calls, finish)
    for c_ in calls.values():
        assert c_["id"] and c_["name"] in ("get_weather", "get_time")
        jsonschema.validate(json.loads(c_["arguments"]), schema_of(tools, c_["name"]))
    # The call as the client assembled it goes back with its result, streamed too.
    call = calls[0]
    messages = [
        {"role": "user", "content": "Use a tool to get the weather in Oslo."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "-3 degrees celsius, snowing"},
    ]
    content, calls, finish = streamed(c.chat.completions.create(model=server.model, messages=messages, tools=tools, temperature=0, max_tokens=60, stream=True))
    assert finish in ("stop", "tool_calls") and (content.strip() or calls), (content, calls, finish)
    for c_ in calls.values():
        jsonschema.validate(json.loads(c_["arguments"]), schema_of(tools, c_["name"]))


def test_one_call_without_parallel_calls(server):
    c = client(server)
    tools = [WEATHER, TIME]
    r = c.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "What is the weather in Paris, Rome and Berlin?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


def every_schema(server):
    c = client(server)

    def one(case):
        tool, question = case
        r = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": question}], tools=[tool], tool_choice="required", temperature=0, max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (tool["function"]["name"], choice)
        check_calls(choice.message.tool_calls, [tool])
        return tool["function"]["name"]

    with ThreadPoolExecutor(4) as pool:
        names = list(pool.map(one, CASES))
    assert len(names) == len(CASES) >= 30


def test_every_schema_is_called_validly_on_the_cpu(server):
    every_schema(server)


def test_every_schema_is_called_validly_on_the_device(gpu_server):
    every_schema(gpu_server)
