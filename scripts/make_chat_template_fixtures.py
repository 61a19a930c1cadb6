#!/usr/bin/env python3
"""Renders the chat-template fixtures of `text/src/chat_template` with `transformers`.

For every `<model>.jinja` in `tests/data/chat_templates/` (with its `<model>.json`
holding `bos_token` / `eos_token`), renders a set of conversations through
`PreTrainedTokenizerFast.apply_chat_template(..., tokenize=False)` and writes each
result (or the template's own error message) to `expected.json` beside them. The Rust
tests assert byte-for-byte equality with every rendering.

`strftime_now` (Llama 3.2's "Today Date") is pinned to FIXED_NOW so the output does not
depend on the day the script ran; the Rust side reads the same instant from
`expected.json` and passes it through `RenderOptions::now`.

Usage: python3 scripts/make_chat_template_fixtures.py  (needs `transformers` and `jinja2`).
"""

import os as _os
import sys as _sys

# scripts/profile.py would shadow the standard library's `profile` (torch imports it):
# keep this folder off the module path before anything else is imported.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import datetime as _datetime
import json
import sys
from pathlib import Path

import jinja2
import transformers
import transformers.utils.chat_template_utils as ctu
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "chat_templates"
FIXED_NOW = _datetime.datetime(2024, 9, 5, 14, 3, 7)


class _FixedDatetime(_datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW


# `strftime_now` looks `datetime` up in the module's globals each time it runs.
ctu.datetime = _FixedDatetime


def tokenizer_for(template: str, tokens: dict) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0}
    for t in tokens.values():
        if t is not None:
            vocab.setdefault(t, len(vocab))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token=tokens.get("bos_token"),
        eos_token=tokens.get("eos_token"),
    )
    tok.chat_template = template
    return tok


SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris."}
U2 = {"role": "user", "content": "And of Italy?"}
A2 = {"role": "assistant", "content": "Rome."}
U3 = {"role": "user", "content": "Thanks!"}
UNICODE = {
    "role": "user",
    "content": "Ünïcödé: 日本語のテキスト, emoji 🦀🔥, Ελληνικά, and \"quotes\" <tags> & 'apostrophes'\n  indented\ttab",
}
PADDED = {"role": "user", "content": "  \n  spaces around  \n\n"}
HTML = {"role": "user", "content": "<script>alert('x & y')</script> \"5 > 3\""}
THINK_A = {
    "role": "assistant",
    "content": "<think>\nThe user wants a capital. France -> Paris.\n</think>\n\nParis.",
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city. Ünïcödé & <ok>",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}

COMMON = [
    ("single_user", [U1], {}),
    ("single_user_gen", [U1], {"add_generation_prompt": True}),
    ("system_user_assistant_user_gen", [SYSTEM, U1, A1, U2], {"add_generation_prompt": True}),
    ("multi_turn", [U1, A1, U2, A2, U3], {}),
    ("multi_turn_gen", [SYSTEM, U1, A1, U2, A2, U3], {"add_generation_prompt": True}),
    ("unicode_gen", [UNICODE], {"add_generation_prompt": True}),
    ("whitespace_content", [SYSTEM, PADDED], {"add_generation_prompt": True}),
    ("html_not_escaped", [HTML], {"add_generation_prompt": True}),
    ("ends_with_assistant", [U1, A1], {}),
]

PER_TEMPLATE = {
    "python_compat": [
        ("tools_and_kwargs", [SYSTEM, U1, A1, U2, A2, U3, PADDED], {"add_generation_prompt": True, "tools": [TOOL], "enable_thinking": False}),
        (
            "reasoning",
            [U1, {"role": "assistant", "content": " Paris. ", "reasoning_content": "Easy."}],
            {"enable_thinking": True},
        ),
        ("error_bad_role", [U1, {"role": "bad", "content": "x"}], {}),
    ],
    "qwen3": [
        ("thinking_absent", [U1], {"add_generation_prompt": True}),
        ("thinking_true", [U1], {"add_generation_prompt": True, "enable_thinking": True}),
        ("thinking_false", [U1], {"add_generation_prompt": True, "enable_thinking": False}),
        ("thinking_false_no_gen", [U1, A1], {"enable_thinking": False}),
        ("think_in_last_assistant", [U1, THINK_A], {}),
        ("think_in_history", [U1, THINK_A, U2], {"add_generation_prompt": True, "enable_thinking": False}),
        (
            "reasoning_content_field",
            [U1, {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy: Paris."}],
            {},
        ),
        (
            "reasoning_content_history",
            [U1, {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."}, U2],
            {"add_generation_prompt": True},
        ),
        ("tools", [SYSTEM, U1], {"add_generation_prompt": True, "tools": [TOOL]}),
    ],
    "qwen2_5": [
        ("tools", [U1], {"add_generation_prompt": True, "tools": [TOOL]}),
        ("tools_with_system", [SYSTEM, U1], {"add_generation_prompt": True, "tools": [TOOL]}),
    ],
    "llama3_2": [
        ("tools_in_user_message", [SYSTEM, U1], {"add_generation_prompt": True, "tools": [TOOL]}),
        (
            "tools_in_system",
            [SYSTEM, U1],
            {"add_generation_prompt": True, "tools": [TOOL], "tools_in_user_message": False},
        ),
        ("date_string_override", [U1], {"add_generation_prompt": True, "date_string": "01 Jan 2030"}),
        # The template's own `raise_exception`: tools but no user message to put them in.
        ("error_tools_without_user", [SYSTEM], {"add_generation_prompt": True, "tools": [TOOL]}),
    ],
    "gemma3": [
        # The template's own `raise_exception`: two user turns in a row.
        ("error_roles_not_alternating", [U1, U2], {"add_generation_prompt": True}),
        ("system_only_gen", [SYSTEM], {"add_generation_prompt": True}),
    ],
    "llama3_1": [
        ("tools_in_user_message", [U1], {"add_generation_prompt": True, "tools": [TOOL]}),
        (
            "builtin_tools",
            [SYSTEM, U1],
            {"add_generation_prompt": True, "builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"]},
        ),
        ("error_tools_without_user", [SYSTEM], {"add_generation_prompt": True, "tools": [TOOL]}),
    ],
}

def render(tok, messages, opts):
    return tok.apply_chat_template(messages, tokenize=False, **opts)


def main():
    cases = []
    names = sorted(p.stem for p in DATA.glob("*.jinja"))
    for name in names:
        template = (DATA / f"{name}.jinja").read_text(encoding="utf-8")
        tokens = json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
        tok = tokenizer_for(template, tokens)
        for case, messages, opts in COMMON + PER_TEMPLATE.get(name, []):
            entry = {"template": name, "name": case, "messages": messages}
            for key in ("add_generation_prompt", "enable_thinking", "tools"):
                if key in opts:
                    entry[key] = opts[key]
            extra = {k: v for k, v in opts.items() if k not in ("add_generation_prompt", "enable_thinking", "tools")}
            if extra:
                entry["extra"] = extra
            try:
                entry["expected"] = render(tok, messages, opts)
            except jinja2.exceptions.TemplateError as e:
                entry["error"] = str(e)
            cases.append(entry)
    out = {
        "generated_by": "scripts/make_chat_template_fixtures.py",
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "now": FIXED_NOW.isoformat(),
        "cases": cases,
    }
    path = DATA / "expected.json"
    path.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    errors = sum("error" in c for c in cases)
    print(f"wrote {len(cases)} cases ({errors} errors) for {len(names)} templates to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
