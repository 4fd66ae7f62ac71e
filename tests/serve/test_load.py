"""A bounded load test (issue 24): 32 concurrent streaming clients of 64 tokens each, every
stream's text equal to its request run alone (greedy), the server's memory back within 10% of
where it started."""

import threading

from openai import OpenAI

PROMPTS = [
    "The history of the printing press",
    "A recipe for bread:",
    "def fibonacci(n):",
    "The three laws of motion are",
    "Once upon a time, in a small village,",
    "The best way to learn a language is",
    "Rivers of Europe, from longest:",
    "Dear hiring manager,",
]
CLIENTS = 32
TOKENS = 64


def test_32_concurrent_streams_each_equal_to_its_request_alone(server):
    c = OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=600)

    def alone(p):
        r = c.completions.create(model=server.model, prompt=p, max_tokens=TOKENS, temperature=0)
        return r.choices[0].text

    expected = {p: alone(p) for p in PROMPTS}
    before = server.rss_kib()
    results, errors = [None] * CLIENTS, []

    def stream(i):
        try:
            p = PROMPTS[i % len(PROMPTS)]
            chunks = c.completions.create(
                model=server.model, prompt=p, max_tokens=TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
            text, usage = "", None
            for ch in chunks:
                if ch.choices:
                    text += ch.choices[0].text
                usage = ch.usage or usage
            results[i] = (p, text, usage)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    ts = [threading.Thread(target=stream, args=(i,)) for i in range(CLIENTS)]
    [t.start() for t in ts]
    [t.join(900) for t in ts]
    assert not errors, errors
    for p, text, usage in results:
        assert text == expected[p], (p, text, expected[p])
        assert usage is not None and usage.completion_tokens <= TOKENS
    after = server.rss_kib()
    assert after <= before * 1.10, (before, after)
