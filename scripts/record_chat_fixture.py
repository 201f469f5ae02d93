#!/usr/bin/env python3
"""Records what transformers' `apply_chat_template` renders for a fixed set of conversations,
for model/tests/chat_template.rs to compare ChatTemplate against (so CI needs no Python).

Templates: the built-in model's (model/assets/default, from model/examples/chat_template.jinja:
the form of Nemotron-3 Nano's template) and tests/fixtures/chat/second_template.jinja (another
ChatML template, JSON tool calls, other Python methods). Writes tests/fixtures/chat/rendered.json.

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install transformers jinja2
    /tmp/venv/bin/python scripts/record_chat_fixture.py

transformers without torch is enough: only the tokenizer and its template are used.

To check another template (a checkpoint's, say) without committing it:

    record_chat_fixture.py --extra nano=PATH/chat_template.jinja --out /tmp/nano.json
    NEMOTRON_CHAT_FIXTURE=/tmp/nano.json cargo test -p model --test chat_template

renders the conversations with only that template (with the built-in model's special tokens)
and stores its source in the fixture, which the test then renders too.
"""

import argparse
import json
import pathlib

import transformers
from transformers import AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/chat/rendered.json"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "  The weather in a city, now.\n",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "Its name, e.g. São Paulo"},
                "days": {"type": "integer"},
                "units": {"type": "string", "enum": ["c", "f"]},
                "detail": {"type": "boolean", "default": False},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"}}}}}

# Schema corners: a type list, nested items, numbers Python prints its own way, a nested
# object, a description with markup.
ODD = {
    "type": "function",
    "function": {
        "name": "tune",
        "description": "Set <knobs> & levels.",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": ["string", "null"], "description": "or null"},
                "levels": {"type": "array", "items": {"type": "number", "minimum": 1e-05, "maximum": 1.5}},
                "shape": {"type": "object", "properties": {"w": {"type": "integer"}}, "nullable": True},
            },
            "required": [],
        },
        "strict": True,
    },
}

SYSTEM = {"role": "system", "content": "You are terse. Use <b>tags</b> & \"quotes\" freely."}
CALL_TURN = {
    "role": "assistant",
    "content": "Checking.",
    "reasoning_content": "The user wants weather.",
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2, "detail": True}}},
        {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": {"q": "föhn", "filters": {"year": [2024, 2025], "lang": None}}}},
    ],
}

CONVERSATIONS = [
    ("system_user", [SYSTEM, {"role": "user", "content": "Hi there!"}], None, True, {}),
    ("user_only_no_prompt", [{"role": "user", "content": "Hello"}], None, False, {}),
    ("thinking_off", [{"role": "user", "content": "2+2?"}], None, True, {"enable_thinking": False}),
    ("thinking_on", [SYSTEM, {"role": "user", "content": "2+2?"}], None, True, {"enable_thinking": True}),
    (
        "multi_turn",
        [
            SYSTEM,
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "<think>\nSmall ones: 2, 3.\n</think>\n\n2"},
            {"role": "user", "content": "Another, 日本語 please."},
            {"role": "assistant", "content": "3", "reasoning_content": "Next prime after 2."},
            {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "a third?"}]},
        ],
        None,
        True,
        {},
    ),
    (
        "multi_turn_keep_thinking",
        [
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "<think>Small ones.</think>2"},
            {"role": "user", "content": "Another."},
        ],
        None,
        True,
        {"keep_history_thinking": True, "enable_thinking": False},
    ),
    ("tools_no_system", [{"role": "user", "content": "Weather in Zürich?"}], [WEATHER, SEARCH], True, {}),
    (
        "tool_round_trip",
        [
            SYSTEM,
            {"role": "user", "content": "Weather in Zürich, and news?"},
            CALL_TURN,
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 4}"},
            {"role": "tool", "tool_call_id": "call_2", "content": "Föhn expected."},
        ],
        [WEATHER, SEARCH],
        True,
        {"enable_thinking": False},
    ),
    (
        "schema_corners_history_kept",
        [
            {"role": "system", "content": "Tune things."},
            {"role": "user", "content": "Tune it."},
            {
                "role": "assistant",
                "content": "<think>Pick levels.</think>Done.",
                "tool_calls": [{"type": "function", "function": {"name": "tune", "arguments": {"name": None, "levels": [0.5, 2, 1e-07], "shape": {"w": 3}}}}],
            },
            {"role": "tool", "content": "ok"},
            {"role": "user", "content": "Again."},
        ],
        [ODD],
        True,
        {"truncate_history_thinking": False, "keep_history_thinking": True},
    ),
    (
        "tool_call_no_content",
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "cold"},
            {"role": "assistant", "content": "It is cold."},
            {"role": "user", "content": "Thanks"},
        ],
        [WEATHER],
        False,
        {"debug_flags": True},
    ),
]

TEMPLATES = {
    "built_in": None,
    "second": (ROOT / "tests/fixtures/chat/second_template.jinja").read_text(),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=PATH", help="record this template instead")
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    templates, sources = TEMPLATES, {}
    if args.extra:
        templates = {}
        for item in args.extra:
            name, _, path = item.partition("=")
            templates[name] = sources[name] = pathlib.Path(path).read_text()
    tok = AutoTokenizer.from_pretrained(ROOT / "model/assets/default")
    cases = []
    for template_name, template in templates.items():
        for name, messages, tools, add_generation_prompt, kwargs in CONVERSATIONS:
            text = tok.apply_chat_template(
                messages,
                tools=tools,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
            cases.append(
                {
                    "template": template_name,
                    "name": name,
                    "messages": messages,
                    "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                    "kwargs": kwargs,
                    "text": text,
                }
            )
    fixture = {"transformers": transformers.__version__, "cases": cases}
    if sources:
        fixture["sources"] = sources
    args.out.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
