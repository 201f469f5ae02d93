"""The `serve` binary through the real OpenAI Python client.

Usage: python client_test.py BASE_URL   (e.g. http://127.0.0.1:8000)

The server must run the built-in model with --slots 8 --max-queue 24 --max-len 512 (what
model/tests/serve.rs starts it with). The built-in model has random weights and a byte
tokenizer: the text means nothing, so the checks compare runs with each other (stream and
not, alone and beside others, restored from the prefix cache and not) and check the protocol. Exits non-zero on the first failure.
"""

import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

from common import bound, check, run

SLOTS, QUEUE, MAX_LEN = 8, 24, 512
BASE = sys.argv[1].rstrip("/")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, timeout=60)
MODEL = "default"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]

bound("client_test", 360)


def chat_stream(messages=CHAT, **kw):
    """(text, token ids, finish_reason, usage, chunks) of a streamed chat completion."""
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, logprobs=True,
        stream_options={"include_usage": True}, extra_body={"return_tokens_as_token_ids": True}, **kw)
    text, ids, finish, usage, chunks = "", [], None, None, []
    for c in stream:
        chunks.append(c)
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            # The built-in model's random text goes to reasoning or content, as the parser splits it.
            text += (getattr(ch.delta, "reasoning_content", None) or "") + (ch.delta.content or "")
            if ch.logprobs and ch.logprobs.content:
                ids += [int(t.token.removeprefix("token_id:")) for t in ch.logprobs.content]
            finish = ch.finish_reason or finish
    return text, ids, finish, usage, chunks


def test_models_and_health():
    check([m.id for m in client.models.list().data] == [MODEL], "models lists the served model")
    with urllib.request.urlopen(BASE + "/health", timeout=10) as r:
        check(r.status == 200, "health is 200")


def test_chat():
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    m = r.choices[0]
    check(r.object == "chat.completion" and m.message.role == "assistant", f"chat response shape: {r}")
    whole = (getattr(m.message, "reasoning_content", None) or "") + (m.message.content or "")
    check(m.finish_reason in ("stop", "length") and whole, f"chat choice: {m}")
    u = r.usage
    check(0 < u.completion_tokens <= 12 and u.prompt_tokens > 0, f"usage: {u}")
    check(u.total_tokens == u.prompt_tokens + u.completion_tokens, f"usage total: {u}")
    text, ids, finish, usage, chunks = chat_stream(max_tokens=12, temperature=0)
    check(chunks[0].choices[0].delta.role == "assistant", "the first chunk carries the role")
    check(all(c.object == "chat.completion.chunk" for c in chunks), "chunk objects")
    check(chunks[-1].choices == [] and chunks[-1].usage is not None, "usage comes in a last chunk of its own")
    check(chunks[-2].choices[0].finish_reason == finish, "the finish reason ends the choice's chunks")
    check((text, finish) == (whole, m.finish_reason), f"stream {text!r} {finish} vs {m}")
    check(usage.model_dump() == u.model_dump(), f"stream usage {usage} vs {u}")
    check(len(ids) == u.completion_tokens, "one logprob per generated token")


def test_completions():
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    c = r.choices[0]
    check(r.object == "text_completion" and c.finish_reason in ("stop", "length"), f"completion: {r}")
    check(r.usage.prompt_tokens == len("Once upon a time".encode()), f"byte tokenizer prompt tokens: {r.usage}")
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for ch in stream:
        usage = ch.usage or usage
        for x in ch.choices:
            text += x.text
            finish = x.finish_reason or finish
    check((text, finish) == (c.text, c.finish_reason), f"stream {text!r} vs {c.text!r}")
    check(usage.completion_tokens == r.usage.completion_tokens, "stream usage")
    ids = list("Once upon a time".encode())
    t = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    check(t.choices[0].text == c.text, "a token-id prompt gives what its text gives")
    lp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logprobs=3,
                                   extra_body={"return_tokens_as_token_ids": True}).choices[0]
    check(len(lp.logprobs.tokens) == 4 and all(len(t) == 3 for t in lp.logprobs.top_logprobs), f"logprobs {lp}")


def test_stop_strings():
    base = client.completions.create(model=MODEL, prompt="abc", max_tokens=60, temperature=0).choices[0].text
    stop = base[20:23]
    want = base[:base.find(stop)]
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=60, temperature=0, stop=[stop, "\x00\x01zz"])
    check((r.choices[0].text, r.choices[0].finish_reason) == (want, "stop"), f"stop {stop!r}: {r.choices[0]}")
    check(getattr(r.choices[0], "stop_reason", "absent") == stop, f"vLLM's stop_reason: {r.choices[0]}")
    check(r.usage.completion_tokens < 60, "a stop string ends the generation early")
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0)
    check((r.choices[0].finish_reason, getattr(r.choices[0], "stop_reason", "absent")) == ("length", None),
          f"no stop_reason at the length: {r.choices[0]}")
    stream = client.completions.create(model=MODEL, prompt="abc", max_tokens=60, temperature=0, stop=stop, stream=True)
    text = "".join(x.text for ch in stream for x in ch.choices)
    check(text == want, f"streamed stop: {text!r} vs {want!r}")


def test_stop_token_ids_and_min_tokens():
    """The greedy first token as a stop token ends the completion at once (its id the
    stop_reason); with min_tokens 3 the engine holds it back for three tokens."""
    kw = dict(model=MODEL, prompt="abc", max_tokens=6, temperature=0, logprobs=0)
    ids_of = lambda choice: [int(t.split(":")[1]) for t in choice.logprobs.tokens]
    base = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    first = ids_of(base)[0]
    free = client.completions.create(
        **kw, extra_body={"return_tokens_as_token_ids": True, "stop_token_ids": [first]}).choices[0]
    check((ids_of(free), free.finish_reason, getattr(free, "stop_reason", None)) == ([first], "stop", first),
          f"stopped at once: {free}")
    held = client.completions.create(
        **kw, extra_body={"return_tokens_as_token_ids": True, "stop_token_ids": [first], "min_tokens": 3}).choices[0]
    ids = ids_of(held)
    check(len(ids) >= 3 and first not in ids[:3], f"min_tokens 3 holds {first} back: {ids}")


def test_structured_outputs():
    """JSON schema, choice and regex outputs from the random built-in model: they parse and hold
    to what was asked (thinking off: the constraint starts with the answer)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b"]}}}}
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    for seed, temperature in [(0, 0.0), (1, 1.0), (2, 1.0)]:
        r = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=200, temperature=temperature, seed=seed, extra_body=no_think,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
        v = json.loads(r.choices[0].message.content)
        check(set(v) == {"name", "age", "tags"} and isinstance(v["age"], int) and 0 <= v["age"] <= 120
              and len(v["name"]) <= 8 and all(t in ("a", "b") for t in v["tags"]) and r.choices[0].finish_reason == "stop",
              f"seed {seed}: {r.choices[0]}")
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0, seed=4,
                                  extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    check(r.choices[0].text in ("left", "right"), f"choice: {r.choices[0]}")
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0, seed=5,
                                  extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"})
    t = r.choices[0].text
    check(len(t) == 5 and t[:2].isupper() and t[2:].isdigit(), f"regex: {t!r}")
    # A forced call: the arguments hold to the function's parameters (the random model writes them).
    tools = [{"type": "function", "function": {"name": "set_level", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["level"],
        "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5}}}}}]
    # (`required`'s list is unbounded: the random model may not close it within the context
    # left here; model/tests/structured.rs checks it.)
    for choice in [{"type": "function", "function": {"name": "set_level"}}]:
        r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, tool_choice=choice, max_tokens=60,
                                           temperature=1.0, seed=9, extra_body=no_think)
        calls = r.choices[0].message.tool_calls or []
        check(len(calls) >= 1 and r.choices[0].finish_reason == "tool_calls", f"{choice}: {r.choices[0]}")
        for call in calls:
            args = json.loads(call.function.arguments)
            check(call.function.name == "set_level" and set(args) == {"level"} and 1 <= args["level"] <= 5, f"{call}")
    status, err = raw("/v1/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "("}})
    check(status == 400 and err["param"] == "structured_outputs.regex", f"{status} {err}")


def raw(path, body):
    """(status, error object) of a POST with a raw body (bytes or JSON-able)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)["error"]


def test_bad_requests_leave_a_stream_unharmed():
    kw = dict(max_tokens=120, temperature=0.9, top_p=0.95, seed=42)
    alone = chat_stream(**kw)[1]
    result = {}
    t = threading.Thread(target=lambda: result.update(ids=chat_stream(**kw)[1]))
    t.start()
    msgs = CHAT
    long_prompt = "x" * (MAX_LEN + 10)
    table = [
        ("/v1/chat/completions", b'{"model": "default", "messages": [', 400, None, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None, None),
        ("/v1/chat/completions", {"messages": msgs, "temperature": "hot"}, 400, "temperature", None),
        ("/v1/chat/completions", {"messages": msgs, "temperature": -1}, 400, "temperature", None),
        ("/v1/chat/completions", {"messages": msgs, "top_p": 0}, 400, "top_p", None),
        ("/v1/chat/completions", {"messages": msgs, "top_p": 1.5}, 400, "top_p", None),
        ("/v1/chat/completions", {"messages": msgs, "n": 2}, 400, "n", None),
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 0}, 400, "max_tokens", None),
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": "many"}, 400, "max_tokens", None),
        ("/v1/chat/completions", {"messages": msgs, "presence_penalty": 3}, 400, "presence_penalty", None),
        ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", None),
        ("/v1/chat/completions", {"messages": msgs, "stream": "yes"}, 400, "stream", None),
        ("/v1/chat/completions", {"messages": msgs, "stop": 5}, 400, "stop", None),
        ("/v1/chat/completions", {"messages": msgs, "response_format": {"type": "xml"}}, 400,
         "response_format", None),
        ("/v1/chat/completions", {"messages": msgs, "tool_choice": "required"}, 400, "tool_choice", None),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias", None),
        ("/v1/chat/completions", {}, 400, "messages", None),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages", None),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": msgs}, 404, "model", "model_not_found"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt}]}, 400, "messages",
         "context_length_exceeded"),
        ("/v1/completions", {"prompt": long_prompt}, 400, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN}, 400, "max_tokens", "context_length_exceeded"),
        ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, "prompt", None),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
        ("/v1/completions", {"prompt": 7}, 400, "prompt", None),
        ("/v1/completions", {}, 400, "prompt", None),
    ]
    for path, body, status, param, code in table:
        got, err = raw(path, body)
        check(got == status, f"{path} {body!r}: status {got}, want {status}: {err}")
        check(set(err) == {"message", "type", "param", "code"} and err["message"], f"error body {err}")
        check((err["param"], err["code"]) == (param, code), f"{body!r}: param/code {err}")
    # The same through the client: its typed errors.
    try:
        client.chat.completions.create(model=MODEL, messages=msgs, temperature=-2)
        check(False, "temperature -2 accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.param == "temperature", f"client error {e}")
    t.join(120)
    check(not t.is_alive() and result.get("ids") == alone, "the stream beside the bad requests got its tokens")


def test_queue_bound_gives_429():
    # Each stream runs to its 450 tokens (ignore_eos), so that the first ones still hold their
    # slots while the rest are opened, on a busy machine too.
    streams = [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=450, stream=True,
                                              extra_body={"ignore_eos": True})
               for _ in range(SLOTS + QUEUE)]
    try:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        check(False, "a request past the queue bound was accepted")
    except openai.RateLimitError as e:
        check(e.status_code == 429 and e.code == "rate_limit_exceeded", f"429 body: {e.body}")
    finally:
        for s in streams:
            s.close()
    # The closed streams' requests are cancelled and their places given back.
    deadline = time.time() + 30
    while True:
        try:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
            break
        except openai.RateLimitError:
            check(time.time() < deadline, "the places of closed streams never came back")
            time.sleep(0.1)


# The built-in model's greedy answer to this runs past 440 tokens (no eos before).
LONG = [{"role": "user", "content": "Tell me a long story."}]


def post_and_hold(body):
    """A socket with a chat request sent on it and its answer not read."""
    host, port = BASE.split("//", 1)[1].rsplit(":", 1)
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=60)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    s.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def dropped_client_frees_its_slot(stream):
    """Every slot runs a greedy request; the client of the one that would run longest goes away
    mid-generation (a stream closed, or the socket of a request that does not stream), and the
    next request gets its slot: it ends before every other request."""
    # Every request runs to its max_tokens (ignore_eos): whether the random model writes an eos
    # is not what this tests.
    long = {"ignore_eos": True}
    if stream:
        dropped = client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=440, temperature=0,
                                                 stream=True, extra_body=long)
        next(iter(dropped))  # running (its role chunk)
    else:
        dropped = post_and_hold({"model": MODEL, "messages": LONG, "max_tokens": 440, "temperature": 0, **long})
    others = [client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=300, temperature=0, stream=True,
                                             extra_body=long)
              for _ in range(SLOTS - 1)]
    for s in others:
        next(iter(s))
    ends = {}

    def drain(i, s):
        finish = None
        for c in s:
            finish = (c.choices[0].finish_reason if c.choices else None) or finish
        ends[i] = (time.time(), finish)

    threads = [threading.Thread(target=drain, args=(i, s)) for i, s in enumerate(others)]
    for t in threads:
        t.start()
    dropped.close()  # the client goes away mid-generation
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    done = time.time()
    check(r.usage.completion_tokens >= 1, "the next request ran")
    for t in threads:
        t.join(120)
    check(len(ends) == SLOTS - 1 and all(f == "length" for _, f in ends.values()),
          f"the other requests ran their 300 tokens: {ends}")
    check(done < min(t for t, _ in ends.values()),
          "the next request got the dropped client's slot (it finished before every other request)")


def test_dropped_client_frees_its_slot():
    dropped_client_frees_its_slot(stream=True)


def test_dropped_non_stream_client_frees_its_slot():
    dropped_client_frees_its_slot(stream=False)


def test_concurrent_seeded_clients_get_their_own_tokens():
    n = 32
    req = lambda i: dict(messages=[{"role": "user", "content": f"client {i}" + " go" * (i % 5)}],
                         max_tokens=16 + i % 7, temperature=0.9, top_p=0.95, seed=1000 + i)
    alone = [chat_stream(**req(i))[:2] for i in range(n)]
    start = threading.Barrier(n)

    def run(i):
        start.wait(30)
        return chat_stream(**req(i))[:2]

    with ThreadPoolExecutor(n) as pool:
        together = list(pool.map(run, range(n)))
    for i, (a, b) in enumerate(zip(alone, together)):
        check(a == b, f"client {i}: alone {a[1]} vs beside 31 others {b[1]}")
    check(all(ids for _, ids in alone), "every client got tokens")


def test_prefix_cache_restores_a_shared_prefix():
    system = {"role": "system", "content": "You answer questions about the sea, briefly. " * 8}
    first = [system, {"role": "user", "content": "Why is it salty?"}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
    check(r1.usage.prompt_tokens_details.cached_tokens == 0, f"a new system prompt is not cached: {r1.usage}")
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content or "Salt."},
                      {"role": "user", "content": "And blue?"}]
    # The second turn stops its prefill where it parts from the first for a snapshot (a branch
    # point); the same turn again restores that much, and gets the same greedy tokens.
    again = [client.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0,
                                            logprobs=True, extra_body={"return_tokens_as_token_ids": True})
             for _ in range(2)]
    (a, b), (ua, ub) = [r.choices[0].logprobs.content for r in again], [r.usage for r in again]
    check([t.token for t in a] == [t.token for t in b], f"restored, the same tokens: {a} vs {b}")
    cached = ub.prompt_tokens_details.cached_tokens
    check(len(system["content"]) <= cached < ub.prompt_tokens, f"the shared prefix restored: {ub} after {ua}")


TESTS = [
    test_models_and_health,
    test_chat,
    test_prefix_cache_restores_a_shared_prefix,
    test_completions,
    test_stop_strings,
    test_stop_token_ids_and_min_tokens,
    test_structured_outputs,
    test_bad_requests_leave_a_stream_unharmed,
    test_queue_bound_gives_429,
    test_dropped_client_frees_its_slot,
    test_dropped_non_stream_client_frees_its_slot,
    test_concurrent_seeded_clients_get_their_own_tokens,
]

if __name__ == "__main__":
    run("client_test", TESTS, f"openai {openai.__version__} against {BASE}")
