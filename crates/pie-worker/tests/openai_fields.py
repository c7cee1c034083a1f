"""Walks every field of the installed OpenAI SDK's request types against a Pie
server (a worker or a controller): each field, sent with a typical value,
must be served (200) or refused with a 400 naming it (`param`); a refused
field must pass with the value that changes nothing; a misspelt field must be
refused by name. Prints a JSON report; exits non-zero on a field nobody
decided (the SDK gained one: give it a rule in `pie_core::openai_fields` and
a sample here).
"""
import json
import sys
import urllib.error
import urllib.request

from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

# A typical value for every SDK field, and for those Pie refuses unless
# inert, the inert one.
SAMPLES = {
    "model": (None, None),  # filled in with the served model
    "prompt": ("hello", None),
    "messages": ([{"role": "user", "content": "hi"}], None),
    "max_tokens": (3, None),
    "max_completion_tokens": (3, None),
    "temperature": (0.5, None),
    "top_p": (0.9, None),
    "seed": (7, None),
    "stop": (["\n\n"], None),
    "stream_options": ({"include_usage": True}, None),
    "n": (2, 1),
    "best_of": (2, 1),
    "echo": (True, False),
    "suffix": ("end", ""),
    "logprobs": (None, None),  # per route below
    "top_logprobs": (2, 0),
    "user": ("u-1", None),
    "frequency_penalty": (1.0, 0),
    "presence_penalty": (1.0, 0),
    "logit_bias": ({"42": -100}, {}),
    "metadata": ({"k": "v"}, None),
    "store": (False, None),
    "safety_identifier": ("s-1", None),
    "prompt_cache_key": ("k-1", None),
    "prompt_cache_retention": ("in-memory", None),
    "prompt_cache_options": ({}, None),
    "service_tier": ("auto", None),
    "moderation": ({}, None),
    "response_format": ({"type": "json_object"}, {"type": "text"}),
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], []),
    "tool_choice": ("required", "auto"),
    "parallel_tool_calls": (False, None),
    "functions": ([{"name": "f", "parameters": {"type": "object"}}], []),
    "function_call": ("auto", None),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "modalities": (["text", "audio"], ["text"]),
    "prediction": ({"type": "content", "content": "x"}, None),
    "web_search_options": ({}, None),
    "reasoning_effort": ("low", None),
    "verbosity": ("low", None),
}
LOGPROBS = {"completions": (2, 0), "chat": (True, False)}
# Fields that mean something only beside another (OpenAI's own rule).
TOOLS = SAMPLES["tools"][0]
COMPANIONS = {"top_logprobs": {"logprobs": True}, "tool_choice": {"tools": TOOLS},
              "parallel_tool_calls": {"tools": TOOLS}}


def post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def walk(url, route, path, fields, base):
    report = {"served": [], "refused": [], "undecided": [], "wrong": []}
    for field in sorted(fields):
        if field not in SAMPLES:
            report["undecided"].append(f"{field}: no sample (decide it)")
            continue
        live, inert = LOGPROBS[route] if field == "logprobs" else SAMPLES[field]
        if field in base:
            continue
        status, answer = post(url, path, {**base, **COMPANIONS.get(field, {}), field: live})
        error = (answer or {}).get("error") or {}
        if status == 200:
            report["served"].append(field)
        elif status == 400 and error.get("param") == field:
            if "Unrecognized" in error.get("message", ""):
                report["undecided"].append(f"{field}: {error['message']}")
                continue
            report["refused"].append(field)
            if inert is not None:
                status, answer = post(url, path, {**base, field: inert})
                if status != 200:
                    report["wrong"].append(f"{field} = {inert!r} (inert): {status} {answer}")
        else:
            report["wrong"].append(f"{field} = {live!r}: {status} {answer}")
    status, answer = post(url, path, {**base, "temprature": 0.5})
    error = (answer or {}).get("error") or {}
    report["typo"] = {"status": status, "param": error.get("param")}
    return report


def main():
    url = sys.argv[1]
    model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
    SAMPLES["model"] = (model, None)
    routes = {
        "completions": ("/v1/completions", completion_params.CompletionCreateParamsBase,
                        {"model": model, "prompt": "hello", "max_tokens": 3}),
        "chat": ("/v1/chat/completions", chat_params.CompletionCreateParamsBase,
                 {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    }
    report = {}
    for route, (path, params, base) in routes.items():
        report[route] = walk(url, route, path, params.__annotations__, base)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
