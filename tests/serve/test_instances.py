"""`--instances N` on the CPU: N guest instances, one copy of the weights (the guest
pre-initialized with the model loaded, its memory image mapped into every instance)."""

import threading

import httpx


def busy(server, n):
    """`n` requests at once (a slot on every instance); their texts."""
    out = [None] * n

    def go(i):
        body = {"model": server.model, "prompt": f"Item {i}: the", "max_tokens": 6, "temperature": 0}
        out[i] = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]

    ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return out


def test_three_instances_hold_one_copy_of_the_weights(start):
    one = start("--instances", "1", "--parallel", "3")
    three = start("--instances", "3", "--parallel", "3")
    assert "3 instance(s)" in three.stderr()
    texts_one, texts_three = busy(one, 3), busy(three, 3)
    # Every instance of the pre-initialized guest computes what a freshly loaded one does.
    assert texts_one == texts_three, (texts_one, texts_three)
    a, b = one.pss_kib(), three.pss_kib()
    # Three copies of the weights would be about three times one instance's memory.
    assert b < 1.3 * a, (a, b)
