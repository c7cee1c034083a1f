"""Drives `pie serve` with the unmodified OpenAI Python SDK; prints what it saw as JSON."""
import json
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
model = client.models.list().data[0].id

completion = client.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})

chunks = list(
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        # Greedy: sampled bytes from the test model need not form UTF-8, and
        # then no content chunk is sent (the chunk count below would vary).
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
)
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

with_props = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "props please"}],
    max_tokens=3,
    extra_body={"props": {"priority": 3, "tag": "sdk"}, "session": "sdk-1", "ignore_eos": True},
)

try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], extra_body={"props": {"priority": "high"}})
    bad_props = None
except openai.BadRequestError as e:
    bad_props = e.body

print(json.dumps({
    "model": model,
    "completion_text": completion.choices[0].text,
    "completion_tokens": completion.usage.completion_tokens,
    "chunk_count": len(chunks),
    "streamed_text": streamed,
    "stream_usage": chunks[-1].usage.completion_tokens if chunks[-1].usage else None,
    "finish_reason": [c.choices[0].finish_reason for c in chunks if c.choices][-1],
    "props_id": with_props.id,
    "props_answer": with_props.choices[0].message.content,
    "bad_props": bad_props,
}))
