#!/usr/bin/env python3
"""The openai Python client against `engine serve --reasoning-parser`: a reasoning model's
thinking read where clients read it, each feature asserted.

    pip install openai
    engine make-model --arch qwen3 --out /tmp/qwen3-tiny
    engine serve /tmp/qwen3-tiny --reasoning-parser qwen3 \
        --enable-auto-tool-choice --tool-call-parser hermes --port 8003 &
    python3 scripts/reasoning_check.py http://127.0.0.1:8003

The random model's thinking is steered by a bias on `</think>`: -100 never ends it (the
output is all reasoning), +100 ends it at once (the answer follows, here under a grammar).
Checks: the chat's `message.reasoning` and `content`, streamed `delta.reasoning` adding up
to the same text, `completion_tokens_details.reasoning_tokens`, a grammar that waits for
`</think>`, `enable_thinking: false`, a turn's reasoning sent back, a tool call after the
thinking (Qwen3's hermes format, which a regex makes the model write once it has thought),
whole and through the SDK's stream helper; the Responses API's `reasoning` item, whole and
through the SDK's stream helper, and a reasoning item sent back.
"""
import json
import sys
import urllib.request

import openai

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8003"
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
model = client.models.list().data[0].id
checks = []


def check(name, ok, detail=""):
    checks.append(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + str(detail) if detail else ''}")


req = urllib.request.Request(f"{base}/tokenize", data=json.dumps({"prompt": "</think>"}).encode(),
                             headers={"content-type": "application/json"})
with urllib.request.urlopen(req) as resp:
    end = json.load(resp)["tokens"]
if len(end) != 1:
    sys.exit(f"</think> is {len(end)} tokens in {model}'s vocabulary: serve a reasoning model")
end = end[0]
messages = [{"role": "user", "content": "Is it raining in Oslo?"}]
# Sampled with a seed: a varied text, the same each time.
never = {"logit_bias": {str(end): -100}, "ignore_eos": True, "seed": 7}
at_once = {"logit_bias": {str(end): 100}, "structured_outputs": {"choice": ["yes", "no"]}}

# Never done thinking: all reasoning, no content.
r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0,
                                   extra_body=never)
m = r.choices[0].message
thought = getattr(m, "reasoning", None)
check("chat: an output without </think> is all reasoning",
      isinstance(thought, str) and thought and m.content is None, m)
check("chat: usage's reasoning_tokens",
      r.usage.completion_tokens_details is not None
      and r.usage.completion_tokens_details.reasoning_tokens == 8, r.usage)
pieces, content = [], []
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                            temperature=1.0, stream=True, extra_body=never):
    for c in chunk.choices:
        pieces.append(getattr(c.delta, "reasoning", None) or "")
        content.append(c.delta.content or "")
check("chat streamed: delta.reasoning adds up to the same reasoning",
      "".join(pieces) == thought and "".join(content) == "", ("".join(pieces), thought))

# `</think>` at once, then a grammar's answer: the grammar waited for the thinking's end.
r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                   extra_body=at_once)
m = r.choices[0].message
check("chat: the answer after </think> follows the grammar",
      m.content in ("yes", "no") and getattr(m, "reasoning", None) is None, m)

# Thinking off (Qwen3's template variable): all content.
r = client.chat.completions.create(
    model=model, messages=messages, max_tokens=8, temperature=1.0,
    extra_body={**never, "chat_template_kwargs": {"enable_thinking": False}})
check("chat: enable_thinking false leaves it all content", r.choices[0].message.content == thought,
      r.choices[0].message)

# A turn's reasoning sent back, as the SDK's message carries it.
turn = {"role": "assistant", "content": "No.", "reasoning": thought}
r = client.chat.completions.create(model=model, messages=messages + [turn, {"role": "user", "content": "Sure?"}],
                                   max_tokens=2)
check("chat: an assistant turn's reasoning sent back is taken", r.choices[0].finish_reason is not None)

# A tool call after the thinking, as Qwen3 makes one: the parser reads the content alone.
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
hermes = r'\n\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
ask = dict(model=model, messages=messages, tools=tools, temperature=0, max_tokens=200,
           extra_body={"logit_bias": {str(end): 100}, "structured_outputs": {"regex": hermes}})
try:
    m = client.chat.completions.create(**ask).choices[0]
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls or []]
    check("chat: a tool call after the thinking",
          calls == [("get_weather", {"city": "Oslo"})] and m.finish_reason == "tool_calls"
          and m.message.content == "\n\n" and getattr(m.message, "reasoning", None) is None,
          (m.finish_reason, m.message))
    with client.chat.completions.stream(**ask) as s:
        for _ in s:
            pass
        f = s.get_final_completion().choices[0]
    streamed = [(t.function.name, json.loads(t.function.arguments)) for t in f.message.tool_calls or []]
    check("chat streamed (the SDK's helper): the same call", streamed == calls
          and f.finish_reason == "tool_calls", (f.finish_reason, f.message))
except openai.BadRequestError as err:
    check("chat: a tool call after the thinking", False,
          f"{err} (start the server with --enable-auto-tool-choice --tool-call-parser hermes)")

# The Responses API: a reasoning item first.
resp = client.responses.create(model=model, input=messages, max_output_tokens=8,
                               temperature=1.0, extra_body=never)
item = resp.output[0]
check("responses: the thinking is a reasoning item",
      item.type == "reasoning" and item.content[0].text == thought, item)
check("responses: output_tokens_details.reasoning_tokens",
      resp.usage.output_tokens_details.reasoning_tokens == 8, resp.usage)
kinds = []
with client.responses.stream(model=model, input="Is it raining in Oslo?", max_output_tokens=8,
                             temperature=0, extra_body=at_once) as stream:
    for event in stream:
        kinds.append(event.type)
    final = stream.get_final_response()
check("responses streamed (the SDK's helper): the answer after </think>",
      final.output_text in ("yes", "no") and "response.output_text.delta" in kinds, (final.output_text, kinds))
with client.responses.stream(model=model, input=messages, max_output_tokens=8,
                             temperature=1.0, extra_body=never) as stream:
    deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
check("responses streamed: reasoning_text deltas add up to the thinking", "".join(deltas) == thought,
      deltas)
again = client.responses.create(
    model=model, max_output_tokens=2,
    input=[{"role": "user", "content": "Is it raining in Oslo?"},
           item.model_dump(exclude_none=True),
           {"role": "assistant", "content": "No."},
           {"role": "user", "content": "Sure?"}])
check("responses: a reasoning item sent back as input is taken", again.usage.input_tokens > 0)

print(f"{sum(checks)} of {len(checks)} checks passed")
sys.exit(0 if all(checks) else 1)
