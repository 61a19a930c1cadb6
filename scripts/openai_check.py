#!/usr/bin/env python3
"""Drives a running `kiln serve` with the official `openai` Python client (the independent
reference for the API's shape): a plain chat completion, a streamed one with usage, a text
completion, the model list, and an error. Prints `openai client: ok` when every check passes.

    python3 scripts/openai_check.py --base-url http://127.0.0.1:8080/v1 --model NAME [--install]

With --install, the `openai` package is installed from PyPI first when it is missing
(scripts/requirements-serve.txt pins it).
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def ensure_openai(install):
    try:
        import openai  # noqa: F401
    except ImportError:
        if not install:
            sys.exit("the openai package is missing: pip install -r scripts/requirements-serve.txt")
        req = os.path.join(HERE, "requirements-serve.txt")
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-r", req])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--install", action="store_true")
    args = ap.parse_args()
    ensure_openai(args.install)
    import openai

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)

    models = client.models.list()
    assert [m.id for m in models.data] == [args.model], models

    messages = [{"role": "user", "content": "Say hello."}]
    plain = client.chat.completions.create(model=args.model, messages=messages, max_tokens=8, temperature=0)
    choice = plain.choices[0]
    assert choice.message.role == "assistant", plain
    assert choice.finish_reason in ("stop", "length"), plain
    assert plain.usage.completion_tokens >= 1 and plain.usage.prompt_tokens > 0, plain.usage

    stream = client.chat.completions.create(
        model=args.model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == (choice.message.content or ""), (text, choice.message.content)
    assert finish == choice.finish_reason, finish
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens, usage

    comp = client.completions.create(model=args.model, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 5, comp

    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404

    print("openai client: ok")


if __name__ == "__main__":
    main()
