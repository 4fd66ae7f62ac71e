"""Log-probabilities and several choices through the unmodified `openai` client."""

import math

from openai import OpenAI


def client(server):
    return OpenAI(base_url=server.v1, api_key="none", timeout=600)


def test_chat_logprobs_are_the_models_own_and_spell_the_text(server):
    c = client(server)
    r = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Name three colors."}], temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    tokens = choice.logprobs.content
    assert tokens and "".join(t.token for t in tokens) == choice.message.content
    for t in tokens:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        # Greedy: the picked token is the most likely one.
        assert t.top_logprobs[0].token == t.token and math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-6)
        assert bytes(t.bytes) == t.token.encode()
    # Streamed: the same tokens and values.
    stream = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Name three colors."}], temperature=0, max_tokens=12, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in tokens]


def test_sampled_logprobs_are_before_the_temperature(server):
    c = client(server)
    r = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say a word."}], temperature=1.5, seed=5, max_tokens=8, logprobs=True, top_logprobs=20
    )
    for t in r.choices[0].logprobs.content:
        assert len(t.top_logprobs) == 20
        # Among the 20 most likely tokens' probabilities, under the model's own softmax.
        assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1 + 1e-4
        listed = {a.token: a.logprob for a in t.top_logprobs}
        if t.token in listed:
            assert math.isclose(listed[t.token], t.logprob, abs_tol=1e-6)


def test_text_completion_logprobs(server):
    c = client(server)
    r = c.completions.create(model=server.model, prompt="def add(a, b):", temperature=0, max_tokens=8, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(t) <= 2 and len(t) >= 1 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and all(b > a for a, b in zip(lp.text_offset, lp.text_offset[1:]))


def test_n_choices_share_the_prompt_and_differ(server):
    c = client(server)
    r = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Write a name for a cat."}], temperature=1.2, seed=11, max_tokens=10, n=4
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    texts = [ch.message.content for ch in r.choices]
    assert len(set(texts)) > 1, texts
    assert r.usage.completion_tokens >= 4 and r.usage.prompt_tokens > 0
    # The same request, the same choices (each its own seed).
    again = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Write a name for a cat."}], temperature=1.2, seed=11, max_tokens=10, n=4
    )
    assert [ch.message.content for ch in again.choices] == texts
    # Streamed: each choice's chunks under its index, each with its finish.
    stream = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Write a name for a cat."}], temperature=1.2, seed=11, max_tokens=10, n=4, stream=True
    )
    text, finished = {}, set()
    for chunk in stream:
        for ch in chunk.choices:
            text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2, 3} and [text[i] for i in range(4)] == texts
