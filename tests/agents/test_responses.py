"""OpenAI's Responses API (`/v1/responses`) through the unmodified `openai` client: text, streamed
and not, function tools and their outputs, `previous_response_id`, `text.format`."""

import json

import jsonschema
from openai import OpenAI

from tools import WEATHER

TOOL = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"], "parameters": WEATHER["function"]["parameters"]}


def client(server):
    return OpenAI(base_url=server.v1, api_key="none", timeout=600)


def test_a_response_and_its_stream(server):
    c = client(server)
    kwargs = dict(model=server.model, instructions="Be brief.", input="Name a color.", max_output_tokens=16, temperature=0)
    r = c.responses.create(**kwargs)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    events = list(c.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text


def test_previous_response_id_continues_the_conversation(server):
    c = client(server)
    first = c.responses.create(model=server.model, input="My name is Ada. Say OK.", max_output_tokens=8, temperature=0)
    second = c.responses.create(model=server.model, input="What is my name?", previous_response_id=first.id, max_output_tokens=12, temperature=0)
    assert "Ada" in second.output_text, second.output_text
    # Its earlier turns are in the prompt, whose keys and values the prompt cache kept.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_a_function_tool_is_called_and_its_output_goes_back(server):
    c = client(server)
    r = c.responses.create(model=server.model, input="What is the weather in Paris?", tools=[TOOL], tool_choice="required", max_output_tokens=120, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", r.output
    jsonschema.validate(json.loads(calls[0].arguments), TOOL["parameters"])
    again = c.responses.create(
        model=server.model,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees celsius, cloudy"}],
        tools=[TOOL],
        max_output_tokens=60,
        temperature=0,
    )
    assert again.status in ("completed", "incomplete") and again.usage.input_tokens > r.usage.input_tokens
    # Streamed: the call arrives as its item's events.
    events = list(c.responses.create(model=server.model, input="What is the weather in Oslo?", tools=[TOOL], tool_choice="required", max_output_tokens=120, temperature=0, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments)["city"]
    assert events[-1].response.output[-1].type == "function_call"


def test_text_format_json_schema_constrains_the_output(server):
    c = client(server)
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False}
    r = c.responses.create(model=server.model, input="Pick a color.", text={"format": {"type": "json_schema", "name": "pick", "schema": schema}}, max_output_tokens=40, temperature=0)
    jsonschema.validate(json.loads(r.output_text), schema)
