"""Anthropic's Messages API (`/v1/messages`) through the unmodified `anthropic` client: text,
streamed and not, stop reasons, a tool call and its result, the key in `x-api-key`."""

import anthropic
import httpx
import jsonschema
import pytest

from tools import WEATHER

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"], "input_schema": WEATHER["function"]["parameters"]}


def client(server, key="none"):
    return anthropic.Anthropic(base_url=server.url, api_key=key, timeout=600)


def test_a_message_and_its_stop_reasons(server):
    c = client(server)
    m = c.messages.create(model=server.model, max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": "Count from 1 to 20."}], extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 8 and m.usage.input_tokens > 0
    m = c.messages.create(model=server.model, max_tokens=60, messages=[{"role": "user", "content": "Count from 1 to 20, separated by commas."}], stop_sequences=["5"], extra_body={"temperature": 0})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "5" and "5" not in m.content[0].text, m
    m = c.messages.create(model=server.model, max_tokens=200, messages=[{"role": "user", "content": "Say hi."}], extra_body={"temperature": 0})
    assert m.stop_reason == "end_turn"


def test_a_streamed_message_is_the_message(server):
    c = client(server)
    kwargs = dict(model=server.model, max_tokens=20, messages=[{"role": "user", "content": "Name a color."}], extra_body={"temperature": 0})
    whole = c.messages.create(**kwargs)
    with c.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_is_called_and_its_result_goes_back(server, stream):
    c = client(server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=server.model, max_tokens=120, tools=[TOOL], tool_choice={"type": "any"}, messages=messages, extra_body={"temperature": 0})
    if stream:
        with c.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = c.messages.create(**kwargs)
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, TOOL["input_schema"])
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 degrees celsius, cloudy"}]},
    ]
    again = c.messages.create(model=server.model, max_tokens=60, tools=[TOOL], messages=messages, extra_body={"temperature": 0})
    assert again.stop_reason in ("end_turn", "tool_use", "max_tokens")
    assert again.usage.input_tokens > m.usage.input_tokens


def test_errors_are_anthropic_shaped_and_the_key_is_read_from_x_api_key(start):
    s = start("--api-key", "sesame")
    with pytest.raises(anthropic.AuthenticationError):
        client(s, "wrong").messages.create(model=s.model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    m = client(s, "sesame").messages.create(model=s.model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert m.content
    with pytest.raises(anthropic.BadRequestError) as e:
        client(s, "sesame").messages.create(model=s.model, max_tokens=4, messages=[{"role": "system", "content": "Hi"}])
    r = httpx.post(s.url + "/v1/messages", headers={"x-api-key": "sesame"}, json={"model": s.model, "messages": []}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
