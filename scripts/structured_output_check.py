#!/usr/bin/env python3
"""Structured output through the openai Python client, each result validated by
`jsonschema` (an implementation independent of the server's grammar engine).

    pip install openai jsonschema pydantic
    engine serve --structured-outputs-disable-any-whitespace &   # builtin:tiny on :8000
    python3 scripts/structured_output_check.py [BASE_URL]

builtin:tiny has random weights: left free to put whitespace anywhere JSON allows, it can
repeat newlines until `max_tokens` (vLLM's default, and its flag), so the server is started
compact. Checks: 100 sampled `response_format` json_schema generations all parse and
validate; `json_object` parses as an object; the client's own `parse` helper (a pydantic
model as the schema); `tool_choice` "required" and named, as `tool_calls`; a schema that
cannot compile is a 400.
"""
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
from pydantic import BaseModel, Field

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
model = client.models.list().data[0].id
checks = []


def check(name, ok, detail=""):
    checks.append(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + str(detail) if detail else ''}")


schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
messages = [{"role": "user", "content": "Describe a user as JSON."}]


def one(seed):
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=160, temperature=1.0, seed=seed,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "user", "schema": schema, "strict": True}})
    text = r.choices[0].message.content
    try:
        jsonschema.validate(json.loads(text), schema)
        return None
    except (ValueError, jsonschema.ValidationError) as e:
        return f"seed {seed}: {text!r}: {e}"


with ThreadPoolExecutor(8) as pool:
    failures = [f for f in pool.map(one, range(100)) if f]
check("100 sampled json_schema generations validate", not failures, failures[:2])

r = client.chat.completions.create(model=model, messages=messages, max_tokens=200, temperature=0,
                                   response_format={"type": "json_object"})
text = r.choices[0].message.content
try:
    check("json_object is a JSON object", isinstance(json.loads(text), dict), text[:80])
except ValueError:
    check("json_object is a JSON object", r.choices[0].finish_reason == "length",
          f"cut at max_tokens: {text[:80]!r}")


class User(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


parsed = client.chat.completions.parse(model=model, messages=messages, max_tokens=120,
                                       temperature=0, response_format=User)
user = parsed.choices[0].message.parsed
check("the client's parse helper returns its pydantic model", isinstance(user, User), user)

tools = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}},
]
r = client.chat.completions.create(model=model, messages=messages, max_tokens=120, temperature=0,
                                   tools=tools, tool_choice="required")
calls = r.choices[0].message.tool_calls or []
check("tool_choice required gives tool_calls",
      r.choices[0].finish_reason == "tool_calls" and len(calls) > 0
      and all(c.function.name in ("get_weather", "get_time") for c in calls)
      and all(isinstance(json.loads(c.function.arguments), dict) for c in calls),
      [(c.function.name, c.function.arguments) for c in calls])
r = client.chat.completions.create(
    model=model, messages=messages, max_tokens=60, temperature=0, tools=tools,
    tool_choice={"type": "function", "function": {"name": "get_time"}})
call = r.choices[0].message.tool_calls[0]
args = json.loads(call.function.arguments)
check("a named tool_choice calls it", call.function.name == "get_time" and args["zone"] in ("UTC", "CET"),
      call.function.arguments)

try:
    client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                   extra_body={"structured_outputs": {"regex": "("}})
    check("an invalid grammar is refused", False, "accepted")
except openai.BadRequestError as err:
    param = err.body.get("param") if isinstance(err.body, dict) else None
    check("an invalid grammar is refused, naming its field", param == "structured_outputs", err.message)

print(f"{sum(checks)} of {len(checks)} checks passed")
sys.exit(0 if all(checks) else 1)
