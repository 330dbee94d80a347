"""The official OpenAI Python client (the `openai` package) against a real gateway: completions,
chat with a system message, streaming with usage, seed, max_completion_tokens, extra_body top_k,
stop, logprobs / top_logprobs, echo, n. Tiny models in real processes; the target here has a chat
template (a copy of the tiny target with one added), the drafter has none (it drafts over the
target's rendering of the conversation)."""

from __future__ import annotations

import json
import shutil

import openai  # pinned in requirements.lock (a test dependency)
import pytest
import requests

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def oa(stack, tiny_dirs, tmp_path_factory):
    from tests.service_fixtures import gateway, model_server, wait_grpc_healthy, wait_http_ready

    t_dir, _ = tiny_dirs
    chat_dir = tmp_path_factory.mktemp("chat-target") / "tiny-target-chat"
    shutil.copytree(t_dir, chat_dir)
    cfg_path = chat_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    logs = tmp_path_factory.mktemp("openai-logs")
    v, vaddr = model_server("verifier", str(chat_dir), logs)
    procs = [v]
    try:
        wait_grpc_healthy(vaddr, v)
        g, http, _ = gateway(vaddr, stack.drafter_addr, stack.redis.url, logs)
        procs.append(g)
        wait_http_ready(http, g)
        model = requests.get(http + "/v1/models", timeout=10).json()["data"][0]["id"]
        client = openai.OpenAI(base_url=http + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, model, http
    finally:
        for p in reversed(procs):
            p.stop()


PROMPT = "The quick brown fox"


def test_completions(oa):
    client, model, http = oa
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, seed=1)
    raw = requests.post(http + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0},
                        timeout=60).json()
    assert r.choices[0].text == raw["choices"][0]["text"] and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.usage.total_tokens == r.usage.prompt_tokens + 16
    # streaming with usage
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    # echo, logprobs, stop
    e = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, echo=True, logprobs=2)
    assert e.choices[0].text == PROMPT + r.choices[0].text
    assert len(e.choices[0].logprobs.token_logprobs) == 16 and all(x <= 0 for x in e.choices[0].logprobs.token_logprobs)
    text = r.choices[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    s = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert s.choices[0].text == text[:text.find(stop)] and s.choices[0].finish_reason == "stop"


def test_chat(oa):
    client, model, _ = oa
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=12, temperature=0.7,
                                       seed=3, extra_body={"top_k": 20})
    again = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=12, temperature=0.7,
                                           seed=3, extra_body={"top_k": 20})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == again.choices[0].message.content  # seeded: reproducible
    assert r.usage.completion_tokens == 12
    pieces = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=12, temperature=0.7,
                                             seed=3, extra_body={"top_k": 20}, stream=True)]
    assert "".join(pieces) == r.choices[0].message.content
    lp = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                        top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) <= 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)  # greedy: the best


def test_n_completions(oa):
    client, model, _ = oa
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5)
    assert r.choices[0].text == one.choices[0].text  # choice 0 keeps the request's seed
    msgs = [{"role": "user", "content": "Say hi"}]
    c = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=6, temperature=1.0,
                                       seed=5, n=2)
    assert len(c.choices) == 2 and all(ch.message.role == "assistant" for ch in c.choices)
    assert c.usage.completion_tokens == 12


def test_errors_come_back_as_openai_errors(oa):
    client, model, _ = oa
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, stop=["a", "b", "c", "d", "e"])
    assert "stop" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, logprobs=50)
