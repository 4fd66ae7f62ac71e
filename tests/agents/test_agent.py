"""An agent loop of a real framework (`openai-agents`, unmodified) over wisp's chat completions:
the model calls a Python function tool, the framework runs it, and its result is the answer
(`tool_use_behavior="stop_on_first_tool"`: Qwen2.5-Coder-0.5B, given the result, calls the tool
again rather than answer from it; test_tools.py has the 1.5B answering from a result)."""

import asyncio

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI


def test_an_agent_calls_a_python_function_to_answer(server):
    set_tracing_disabled(True)
    called = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        called.append(city)
        return f"It is 18 degrees celsius and cloudy in {city}."

    model = OpenAIChatCompletionsModel(model=server.model, openai_client=AsyncOpenAI(base_url=server.v1, api_key="none", timeout=600))
    agent = Agent(
        name="weather",
        instructions="Answer with the tools you have.",
        model=model,
        tools=[get_weather],
        model_settings=ModelSettings(temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert called and called[0].lower().startswith("paris"), called
    assert "18" in str(result.final_output), result.final_output
