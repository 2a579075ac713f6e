#!/usr/bin/env python3
"""The openai Python client against `engine serve`: the features clients rely on, each
asserted, so that a failure names what broke.

    pip install openai
    engine serve --enable-auto-tool-choice --tool-call-parser hermes &   # builtin:tiny, :8000
    python3 scripts/openai_client_check.py [BASE_URL [PARSER]]

PARSER: the server's `--tool-call-parser`, `hermes` (the default), `pythonic` or
`qwen3_coder`.

Checks: `n=2` (completions, chat, chat streaming), a batch of prompts (texts and token-id
lists, with `n=2`, streamed too), `logit_bias` (a +100 bias makes the
token certain, a -100 bias forbids the likeliest one), `echo` with `logprobs` and
`max_tokens=0` (prompt logprobs, as evaluation harnesses ask for them), seeded sampling
reproducible, vLLM's `return_token_ids` and `bad_words`, `priority` refused by a server
without priority scheduling (as vLLM refuses it), an unsupported parameter refused with 400
naming it, and tool calls under
`tool_choice="auto"` (a regex makes the random model write a call in the parser's format) answered as
`tool_calls`, streamed too (the SDK's stream helper accumulates them). The Responses API:
the chat's text for the same messages, cut at `max_output_tokens`; streamed through the
SDK's helper with a JSON schema; logprobs; a function call and its output sent back; a
`previous_response_id` not found.
"""
import json
import sys
import urllib.request

import openai

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
parser = sys.argv[2] if len(sys.argv) > 2 else "hermes"
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
model = client.models.list().data[0].id
checks = []


def post(path, body):
    """The server's own (non-/v1) endpoints: /tokenize, /detokenize."""
    req = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        return json.load(resp)


def check(name, ok, detail=""):
    checks.append(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + str(detail) if detail else ''}")


prompt = "The harbor town sat at the mouth of a shallow river, and"

# n = 2: two choices from one prompt, in order, usage counting the prompt once.
r = client.completions.create(model=model, prompt=prompt, max_tokens=8, n=2, temperature=1.0, seed=3)
check("completions n=2", [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 16,
      [c.index for c in r.choices])
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                   max_tokens=6, n=2, temperature=1.0, seed=3)
check("chat n=2", sorted(c.index for c in r.choices) == [0, 1])
seen = set()
for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, n=2, stream=True, temperature=1.0, seed=3):
    seen.update(c.index for c in chunk.choices)
check("chat n=2 streaming", seen == {0, 1}, seen)

# A batch of prompts with n = 2: choices prompt by prompt, each prompt's alone as greedy
# decoding gives it; texts and token-id lists alike, streamed too.
texts = [prompt, "Down at the old mill", "A letter came"]
alone = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0).choices[0].text
         for p in texts]
r = client.completions.create(model=model, prompt=texts, max_tokens=5, n=2, temperature=0)
check("prompt=[texts] with n=2", [c.index for c in r.choices] == list(range(6))
      and [c.text for c in r.choices] == [a for a in alone for _ in range(2)]
      and r.usage.completion_tokens == 30, [c.text for c in r.choices])
ids = [post("/tokenize", {"prompt": p})["tokens"] for p in texts]
r = client.completions.create(model=model, prompt=ids, max_tokens=5, n=2, temperature=0)
check("prompt=[token ids] with n=2", [c.text for c in r.choices] == [a for a in alone for _ in range(2)],
      [c.text for c in r.choices])
streamed = [""] * 6
for chunk in client.completions.create(model=model, prompt=ids, max_tokens=5, n=2, temperature=0,
                                       stream=True):
    for c in chunk.choices:
        streamed[c.index] += c.text
check("prompt=[token ids] with n=2, streamed", streamed == [a for a in alone for _ in range(2)], streamed)

# Seeded sampling is reproducible.
a = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=11)
b = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=11)
check("seed reproducible", a.choices[0].text == b.choices[0].text)

# logit_bias: -100 on the token greedy decoding picks makes it pick another; +100 on a token
# makes greedy decoding pick it every time.
greedy = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
likeliest = greedy.choices[0].text
ids = post("/tokenize", {"prompt": likeliest, "add_special_tokens": False})["tokens"]
check("the greedy token's text is one token", len(ids) == 1, ids)
banned = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                   logit_bias={str(ids[0]): -100})
check("logit_bias -100 forbids the likeliest token", banned.choices[0].text != likeliest,
      (likeliest, banned.choices[0].text))
forced = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                   logit_bias={"42": 100})
t42 = post("/detokenize", {"tokens": [42]})["prompt"]
check("logit_bias +100 makes a token certain", forced.choices[0].text == t42 * 3,
      (forced.choices[0].text, t42))

# echo + logprobs + max_tokens=0: the prompt back with each token's logprob (none for the
# first), nothing generated.
e = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
lp = e.choices[0].logprobs
check("echo returns the prompt", e.choices[0].text == prompt)
check("prompt logprobs: none for the first token, one for every other",
      lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
      and len(lp.tokens) == e.usage.prompt_tokens, lp.token_logprobs[:3])

# vLLM's return_token_ids (through extra_body; the SDK keeps the fields it does not know):
# the prompt's ids and each choice's generated ones, as many as the usage counts.
r = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                              extra_body={"return_token_ids": True})
c = r.choices[0]
check("return_token_ids (completions): the prompt's and the generated ids",
      len(c.prompt_token_ids) == r.usage.prompt_tokens
      and len(c.token_ids) == r.usage.completion_tokens, (c.prompt_token_ids, c.token_ids))
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=5, temperature=0, extra_body={"return_token_ids": True})
check("return_token_ids (chat): the rendered prompt's and the generated ids",
      len(r.prompt_token_ids) == r.usage.prompt_tokens
      and len(r.choices[0].token_ids) == r.usage.completion_tokens,
      (r.prompt_token_ids, r.choices[0].token_ids))

# vLLM's bad_words (extra_body): token 42, made certain by a +100 bias, banned as a word (its
# text, one token as vLLM tokenises a bad word) is not sampled; and vLLM's priority, refused
# (400, naming it) by a server started first come, first served, as vLLM refuses it.
ids42 = post("/tokenize", {"prompt": t42.lstrip(), "add_special_tokens": False})["tokens"]
worded = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                   logit_bias={"42": 100},
                                   extra_body={"return_token_ids": True, "bad_words": [t42]})
check("bad_words keeps a banned word's token out, a +100 bias notwithstanding",
      ids42 == [42] and 42 not in worded.choices[0].token_ids,
      (t42, ids42, worded.choices[0].token_ids))
try:
    client.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body={"priority": 1})
    check("priority refused without priority scheduling", False, "accepted")
except openai.BadRequestError as err:
    check("priority refused without priority scheduling",
          "Priority scheduling is not enabled" in str(err), err.status_code)

# A parameter the server does not implement is refused, naming it.
try:
    client.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body={"use_beam_search": True})
    check("unsupported parameter refused", False, "accepted")
except openai.BadRequestError as err:
    check("unsupported parameter refused", "use_beam_search" in str(err), err.status_code)

# tool_choice "auto" (the default with tools): the parser finds the call the model writes;
# hermes's text before it is the content (the other outputs are calls only). Streamed, the
# SDK's helper adds up the same, the arguments in pieces.
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
hermes = r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
call_regex, content = {
    "hermes": (hermes, "Let me check. "),
    "pythonic": (r"\[get_weather\(city='Oslo'\)\]", None),
    "qwen3_coder": (r"<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                    r"</function>\n</tool_call>", None),
}[parser]
ask = dict(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=tools,
           temperature=0, max_tokens=100, extra_body={"structured_outputs": {"regex": call_regex}})
try:
    m = client.chat.completions.create(**ask).choices[0]
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls or []]
    check("auto tool choice: the call and the content before it",
          calls == [("get_weather", {"city": "Oslo"})] and m.message.content == content
          and m.finish_reason == "tool_calls", (m.finish_reason, m.message.content, calls))
    with client.chat.completions.stream(**ask) as s:
        pieces = [e.arguments_delta for e in s
                  if e.type == "tool_calls.function.arguments.delta" and e.arguments_delta]
        f = s.get_final_completion().choices[0]
    streamed = [(t.function.name, json.loads(t.function.arguments)) for t in f.message.tool_calls or []]
    # (The first chunk carries the role and an empty content, as vLLM's does.)
    check("auto tool choice, streamed", streamed == calls and (f.message.content or None) == content
          and f.finish_reason == "tool_calls", (f.finish_reason, f.message.content, streamed))
    # As vLLM streams them: the call's arguments arrive in pieces as they are generated.
    check("auto tool choice, streamed: the arguments in pieces",
          len(pieces) > 1 and "".join(pieces) == f.message.tool_calls[0].function.arguments, pieces)
except openai.BadRequestError as err:
    check("auto tool choice", False, f"{err} (start the server with --enable-auto-tool-choice "
          f"--tool-call-parser {parser})")

# The Responses API (/v1/responses): the same generation as the chat it stands for.
instructions, question = "Answer in one word.", "Where is the harbor?"
chat = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
    {"role": "system", "content": instructions}, {"role": "user", "content": question}])
r = client.responses.create(model=model, instructions=instructions, input=question,
                            max_output_tokens=6, temperature=0)
check("responses: the chat's text, cut at max_output_tokens",
      r.output_text == chat.choices[0].message.content and r.status == "incomplete"
      and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 6
      and r.usage.input_tokens == chat.usage.prompt_tokens, (r.status, r.output_text))
city = {"format": {"type": "json_schema", "name": "weather", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo"]}},
    "required": ["city"], "additionalProperties": False}}}
with client.responses.stream(model=model, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Which city?"}]}], text=city, max_output_tokens=60) as s:
    deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    final = s.get_final_response()
check("responses streamed (the SDK's helper), text.format json_schema",
      deltas == final.output_text and json.loads(final.output_text) == {"city": "Oslo"}
      and final.status == "completed", (final.status, deltas))
r = client.responses.create(model=model, input="Hi", max_output_tokens=3, temperature=0,
                            include=["message.output_text.logprobs"], top_logprobs=2)
lps = r.output[0].content[0].logprobs
check("responses logprobs (include), 2 alternatives a token",
      len(lps) == 3 and all(len(t.top_logprobs) == 2 for t in lps), len(lps))
flat_tools = [dict(type="function", **t["function"]) for t in tools]
try:
    r = client.responses.create(model=model, input="Weather in Oslo?", tools=flat_tools,
                                temperature=0, max_output_tokens=100,
                                extra_body={"structured_outputs": {"regex": call_regex}})
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    kinds = [o.type for o in r.output]
    check("responses: a function_call item (after the message, if any)",
          calls == [("get_weather", {"city": "Oslo"})] and r.output_text == (content or "")
          and kinds == ["message"] * (content is not None) + ["function_call"],
          (r.output_text, kinds, calls))
    call = r.output[-1]
    turn = client.responses.create(model=model, max_output_tokens=2, input=[
        {"role": "user", "content": "Weather in Oslo?"}, call,
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    check("responses: the call and its output sent back as input", turn.usage.input_tokens > 0)
except openai.BadRequestError as err:
    check("responses with tool_choice auto", False, err)
try:
    client.responses.create(model=model, input="Hi", previous_response_id="resp_none")
    check("responses: previous_response_id not found (nothing is stored)", False, "accepted")
except openai.NotFoundError as err:
    check("responses: previous_response_id not found (nothing is stored)",
          err.status_code == 404, err.status_code)

print(f"{sum(checks)} of {len(checks)} checks passed")
sys.exit(0 if all(checks) else 1)
