"""Reasoning and tool calls through the real OpenAI Python client.

Usage: python tool_calls_test.py BASE_URL

The server's engine must be the echo script (model::serve::scripted::echo, which
model/tests/serve.rs serves in-process): it writes back each request's last user message as the
model's output, through the real chat handler (the built-in model's chat template, whose
generation prompt opens a <think> block unless enable_thinking is false; detokenizing; the
output parser) and HTTP stack. So each test sends the text a model would write and checks what
the client makes of it. Exits non-zero on the first failure.
"""

import json
import sys

import openai

from common import bound, check, run

BASE = sys.argv[1].rstrip("/")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, timeout=30)
MODEL = "default"

bound("tool_calls_test", 90)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"},
        "celsius": {"type": "boolean"}, "threshold": {"type": "number"},
        "hours": {"type": "array", "items": {"type": "integer"}}}}}}]

REASONING = "The user wants the forecast.\nThe tool has it."
CONTENT = "Let me look that up."
CALL = ("<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nSan Jose\n</parameter>\n<parameter=zip>\n95110\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=celsius>\ntrue\n</parameter>\n"
        "<parameter=threshold>\n0.5\n</parameter>\n<parameter=hours>\n[6, 12, 18]\n</parameter>\n"
        "</function>\n</tool_call>")
# What the "model" writes: the prompt opened <think>, so it starts in the reasoning.
OUTPUT = f"{REASONING}\n</think>\n{CONTENT}\n{CALL}"
# The arguments typed by the schema: "95110" stays a string, 3 an integer, 0.5 a number.
ARGUMENTS = {"city": "San Jose", "zip": "95110", "days": 3, "celsius": True, "threshold": 0.5, "hours": [6, 12, 18]}


def ask(text):
    return [{"role": "user", "content": text}]


def reasoning_of(x):
    """The reasoning under vLLM's field name and its former one (the client keeps unknown fields)."""
    return getattr(x, "reasoning", None), getattr(x, "reasoning_content", None)


def check_arguments(arguments):
    args = json.loads(arguments)
    check(args == ARGUMENTS, f"arguments {args}")
    check(type(args["days"]) is int and type(args["threshold"]) is float and args["celsius"] is True,
          f"typed per the schema: {args}")


def test_response():
    r = client.chat.completions.create(model=MODEL, messages=ask(OUTPUT), tools=TOOLS)
    choice = r.choices[0]
    m = choice.message
    check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}")
    check(reasoning_of(m) == (REASONING + "\n",) * 2, f"reasoning {reasoning_of(m)}")
    check(m.content == f"\n{CONTENT}\n", f"content {m.content!r}")
    check(len(m.tool_calls) == 1, f"tool_calls {m.tool_calls}")
    call = m.tool_calls[0]
    check(call.type == "function" and call.id.startswith("call_"), f"call {call}")
    check(call.function.name == "get_weather", f"name {call.function.name}")
    check_arguments(call.function.arguments)
    check(r.usage.completion_tokens > 0, f"usage {r.usage}")


def test_stream():
    stream = client.chat.completions.create(model=MODEL, messages=ask(OUTPUT), tools=TOOLS, stream=True,
                                            stream_options={"include_usage": True})
    reasoning, former, content, calls, finishes, usage = "", "", "", {}, [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            d = choice.delta
            r, f = reasoning_of(d)
            reasoning, former, content = reasoning + (r or ""), former + (f or ""), content + (d.content or "")
            for piece in d.tool_calls or []:
                if piece.index not in calls:
                    # A call's first delta: its id, type and name, as OpenAI streams it.
                    check(piece.id and piece.id.startswith("call_") and piece.type == "function", f"{piece}")
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:
                    check(piece.id is None and piece.function.name is None, f"id and name once: {piece}")
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    check((reasoning, former) == (REASONING + "\n",) * 2, f"streamed reasoning {reasoning!r} / {former!r}")
    check(content == f"\n{CONTENT}\n", f"streamed content {content!r}")
    check(finishes == ["tool_calls"], f"one finish reason: {finishes}")
    check(list(calls) == [0] and calls[0]["name"] == "get_weather", f"streamed calls {calls}")
    check_arguments(calls[0]["arguments"])
    whole = client.chat.completions.create(model=MODEL, messages=ask(OUTPUT), tools=TOOLS)
    check(usage is not None and usage.completion_tokens == whole.usage.completion_tokens, f"usage {usage}")


def test_a_call_is_content_without_tools_or_with_tool_choice_none():
    for kw in [{}, {"tools": TOOLS, "tool_choice": "none"}]:
        r = client.chat.completions.create(model=MODEL, messages=ask(OUTPUT), **kw)
        m = r.choices[0].message
        check(r.choices[0].finish_reason == "stop" and not m.tool_calls, f"{kw}: {r.choices[0]}")
        check(m.content == f"\n{CONTENT}\n{CALL}", f"{kw}: content {m.content!r}")


def test_without_thinking_there_is_no_reasoning():
    r = client.chat.completions.create(model=MODEL, messages=ask(CONTENT),
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    check(m.content == CONTENT and reasoning_of(m) == (None, None), f"{m}")


def test_the_call_and_its_result_go_back():
    """The assistant message with its call (arguments as the JSON string the client got) and the
    tool's result render through the template: the next turn answers."""
    first = client.chat.completions.create(model=MODEL, messages=ask(OUTPUT), tools=TOOLS).choices[0].message
    answer = "Sunny, 21 degrees."
    messages = ask(OUTPUT) + [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": json.dumps({"sky": "sunny"})},
        {"role": "user", "content": f"Thanks.\n</think>\n{answer}"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    m = r.choices[0].message
    check((r.choices[0].finish_reason, m.content, m.tool_calls) == ("stop", f"\n{answer}", None), f"{r.choices[0]}")


def test_logprob_bytes_are_each_tokens_own():
    """A token holding part of a character gives that part's bytes (the built-in tokenizer has
    a token a byte): all of them together are the text's bytes, the eos token's after."""
    text = "</think>\nça coûte 5 €"
    r = client.chat.completions.create(model=MODEL, messages=ask(text), logprobs=True)
    entries = r.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in entries)
    check(joined == text.encode() + b"<|im_end|>", f"bytes {joined!r}")
    check([e.bytes for e in entries[-4:-1]] == [[0xE2], [0x82], [0xAC]], f"the euro sign's {entries[-4:-1]}")
    check(r.choices[0].message.content == "\nça coûte 5 €", f"{r.choices[0].message}")


TESTS = [
    test_response,
    test_stream,
    test_a_call_is_content_without_tools_or_with_tool_choice_none,
    test_without_thinking_there_is_no_reasoning,
    test_the_call_and_its_result_go_back,
    test_logprob_bytes_are_each_tokens_own,
]

if __name__ == "__main__":
    run("tool_calls_test", TESTS, f"openai {openai.__version__} against {BASE}")
