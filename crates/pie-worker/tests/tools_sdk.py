"""Tool calls through the unmodified OpenAI Python SDK against a Pie server
(argv[1]): `tool_choice: "required"` 50 times (every fifth streamed, its
`delta.tool_calls` gathered as SDK users do), a named choice, a tool result
sent back, and `auto` asked for a poem. Prints a JSON report."""
import json
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
model = client.models.list().data[0].id

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for the next days",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 16}}}}}
TOOLS = [WEATHER, CLOCK]
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Dakar", "Hanoi", "Bern"]


def invalid(name, arguments):
    """Why a call does not match its tool's schema (None: it does)."""
    try:
        args = json.loads(arguments)
    except ValueError as e:
        return f"arguments are not JSON: {e}"
    if name == "get_weather":
        if set(args) != {"city", "unit", "days"}:
            return f"keys {sorted(args)}"
        if not isinstance(args["city"], str) or len(args["city"]) > 16:
            return "city"
        if args["unit"] not in ("celsius", "fahrenheit"):
            return "unit"
        if type(args["days"]) is not int or not 1 <= args["days"] <= 7:
            return "days"
        return None
    if name == "get_time":
        ok = set(args) == {"zone"} and isinstance(args["zone"], str) and len(args["zone"]) <= 16
        return None if ok else f"zone: {args}"
    return f"no tool named {name}"


def ask(messages, stream, **kw):
    """(calls as (id, name, arguments), content, finish_reason, usage)."""
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, **kw)
        m = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return calls, m.content, r.choices[0].finish_reason, r.usage
    calls, content, finish, usage = {}, "", None, None
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for c in choice.delta.tool_calls or []:
                id_, name, args = calls.get(c.index, ("", "", ""))
                calls[c.index] = (id_ + (c.id or ""), name + (c.function.name or ""), args + (c.function.arguments or ""))
    return [calls[i] for i in sorted(calls)], content or None, finish, usage


def weather_question(i):
    return [{"role": "user", "content": f"What is the weather in {CITIES[i % len(CITIES)]} for the next {i % 7 + 1} days?"}]


failures, streamed = [], 0
for i in range(50):
    stream = i % 5 == 0
    streamed += stream
    calls, _, finish, _ = ask(weather_question(i), stream, tool_choice="required", temperature=1, seed=i, max_tokens=250)
    problems = [invalid(name, args) for _, name, args in calls]
    if not calls or any(problems) or finish != "tool_calls":
        failures.append({"i": i, "calls": calls, "finish": finish, "problems": problems})

named, _, named_finish, _ = ask(weather_question(3), False, temperature=0, max_tokens=250,
                                tool_choice={"type": "function", "function": {"name": "get_time"}})

first_calls, _, _, first_usage = ask(weather_question(0), False, tool_choice="required", temperature=0, max_tokens=250)
call_id, name, arguments = first_calls[0]
result = json.dumps({"temperature": 21, "sky": "clear"})
followup = weather_question(0) + [
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
    {"role": "tool", "tool_call_id": call_id, "content": result},
]
after_calls, after_content, after_finish, after_usage = ask(followup, False, tool_choice="auto", temperature=0, max_tokens=120)

poem_calls, poem, poem_finish, _ = ask([{"role": "user", "content": "Write a haiku about the sea."}], True,
                                       tool_choice="auto", temperature=0, max_tokens=60)

print(json.dumps({
    "required": 50 - len(failures), "streamed": streamed, "failures": failures[:5],
    "named": [c[1] for c in named], "named_invalid": [invalid(c[1], c[2]) for c in named], "named_finish": named_finish,
    "round_trip": {"call": name, "first_prompt": first_usage.prompt_tokens,
                   "first_completion": first_usage.completion_tokens, "prompt": after_usage.prompt_tokens,
                   "calls": len(after_calls), "content": after_content, "finish": after_finish},
    "auto": {"calls": len(poem_calls), "content": poem, "finish": poem_finish},
}))
