"""Drives a running clawrl gateway with the official `openai` Python SDK: chat, streaming,
log-probs and tools. Usage: openai_sdk_check.py BASE_URL API_KEY MODEL. Exits non-zero on any
mismatch."""
import sys

import openai

base, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base + "/v1", api_key=key)

# Models.
assert [m.id for m in client.models.list().data] == [model]

# Chat, non-streaming, with session headers.
msgs = [{"role": "user", "content": "Hello there"}]
r = client.chat.completions.create(
    model=model, messages=msgs, max_tokens=8, temperature=0.7, seed=5,
    extra_headers={"X-Session-Id": "sdk"},
)
text = r.choices[0].message.content
assert isinstance(text, str), r
assert r.choices[0].finish_reason in ("stop", "length"), r
assert r.usage.completion_tokens >= 1, r
assert r.model_extra["session_id"] == "sdk", r.model_extra

# The SDK's own answer resent as history, dumped whole (refusal, audio, function_call and
# annotations as None): served, the nulls count as absent. A side turn, so nothing is recorded.
follow = msgs + [r.choices[0].message.model_dump(), {"role": "user", "content": "Shorter."}]
r2 = client.chat.completions.create(model=model, messages=follow, max_tokens=4,
                                    extra_headers={"X-Turn-Type": "side"})
assert r2.choices[0].message.role == "assistant", r2

# Streaming: same seed, same text, in several chunks.
stream = client.chat.completions.create(
    model=model, messages=msgs, max_tokens=8, temperature=0.7, seed=5, stream=True,
    stream_options={"include_usage": True}, extra_body={"session_id": "sdk-stream"},
)
pieces, finish, usage = [], None, None
for chunk in stream:
    if chunk.usage:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(pieces) == text, (pieces, text)
assert len(pieces) > 1, pieces
assert finish in ("stop", "length"), finish
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage

# Log-probs, parsed into the SDK's typed objects, streamed or not.
r = client.chat.completions.create(
    model=model, messages=msgs, max_tokens=8, temperature=0.7, seed=5, logprobs=True,
    top_logprobs=2, extra_headers={"X-Turn-Type": "side"},
)
lps = r.choices[0].logprobs.content
assert r.choices[0].message.content == text and len(lps) >= 1, r
assert bytes(b for t in lps for b in t.bytes).decode("utf-8", "replace") == text, lps
for t in lps:
    assert t.logprob <= 0 and len(t.top_logprobs) == 2, t
    assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob, t
stream = client.chat.completions.create(
    model=model, messages=msgs, max_tokens=8, temperature=0.7, seed=5, logprobs=True,
    top_logprobs=2, stream=True, extra_headers={"X-Turn-Type": "side"},
)
streamed = [t for c in stream for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in lps], streamed

# Tools: a history with an assistant tool call (arguments as a JSON string) and a tool result.
tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                         "required": ["path"]}}}]
hist = msgs + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "read_file", "arguments": "{\"path\": \"a.txt\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "file contents"},
]
r = client.chat.completions.create(model=model, messages=hist, tools=tools, max_tokens=8,
                                   extra_headers={"X-Session-Id": "sdk", "X-Session-Done": "1"})
m = r.choices[0].message
assert m.role == "assistant" and (m.content is not None or m.tool_calls), m
for tc in m.tool_calls or []:
    assert tc.type == "function" and tc.function.name, tc
stream = client.chat.completions.create(model=model, messages=hist, tools=tools, max_tokens=8,
                                        stream=True)
assert sum(1 for _ in stream) >= 2

# Errors surface as the SDK's typed exceptions.
try:
    client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=2)
    raise AssertionError("unknown model accepted")
except openai.NotFoundError as e:
    assert "no-such-model" in str(e), e
try:
    openai.OpenAI(base_url=base + "/v1", api_key="wrong").chat.completions.create(
        model=model, messages=msgs, max_tokens=2)
    raise AssertionError("wrong key accepted")
except openai.AuthenticationError:
    pass
try:
    client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=5)
    raise AssertionError("temperature 5 accepted")
except openai.BadRequestError as e:
    assert "temperature" in str(e), e
print("openai sdk", openai.__version__, "ok")
