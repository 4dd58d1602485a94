"""The OpenAI-compatible HTTP API over an `Engine` (FastAPI; streams through sse-starlette).

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with "stream": true for
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics
(Prometheus). With an API key, /v1/* and /metrics need `Authorization: Bearer KEY`.

Errors are OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`: 400 malformed JSON
or a field out of range, 422 a field of the wrong type, 401 a missing or wrong key, 404 an
unknown model, 413 a prompt plus max_tokens over the context window, 429 the queue full, 503
the server draining. A client that disconnects cancels its request (its pages are freed).
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from ..sampling import MAX_TOP_LOGPROBS, SamplingError, SamplingOptions
from .engine import Engine, RequestError
from .grammar import GrammarError, JsonGrammars
from .metrics import EngineMetrics
from .prompts import PromptError, completion_prompt, normalize_messages, render_messages


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


# ---------------------------------------------------------------------- field readers
_MISSING = object()


def _field(body: dict, name: str, kinds: tuple, default: Any = None, what: str = "") -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        value = _MISSING
    if value is _MISSING or not isinstance(value, kinds):
        raise APIError(422, f"{name} must be {what}, got {json.dumps(body.get(name))[:60]}", name, "invalid_type")
    return value


def _number(body: dict, name: str, default: Any = None) -> Any:
    return _field(body, name, (int, float), default, "a number")


def _integer(body: dict, name: str, default: Any = None) -> Any:
    return _field(body, name, (int,), default, "an integer")


def _boolean(body: dict, name: str, default: Any = None) -> Any:
    return _field(body, name, (bool,), default, "a boolean")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(422, "stop must be a string or a list of strings", "stop", "invalid_type")
    if len(stop) > 4:
        raise APIError(400, f"stop holds at most 4 strings, got {len(stop)}", "stop")
    return tuple(s for s in stop if s)


class Server:
    """The app's state: engine, model name, tokenizer, chat template, API key, metrics."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None):
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        runner = engine.runner
        self.tokenizer = runner.tokenizer
        self.template = runner.session.runtime.get("chat_template")
        self.created = int(time.time())
        self.metrics = EngineMetrics(engine)
        self.grammars: JsonGrammars | None = None  # xgrammar's compiler, built by the first JSON request
        self._grammars_lock = threading.Lock()

    # -------------------------------------------------------------- shared request handling
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", None,
                           "invalid_api_key", "authentication_error")

    async def body(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise APIError(400, f"the request body is not valid JSON ({err})") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        n = body.get("n")
        if n is not None and n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {json.dumps(n)}", "n")
        return body

    def options(self, body: dict, prompt_len: int, chat: bool) -> SamplingOptions:
        runner = self.engine.runner
        max_tokens = _integer(body, "max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens")
        if max_tokens is None:
            room = min(runner.context_window, runner.total_tokens) - prompt_len
            max_tokens = max(room, 1) if chat else min(16, max(room, 1))
        if chat:
            logprobs = _boolean(body, "logprobs", False)
            top = _integer(body, "top_logprobs", 0)
        else:
            top = _integer(body, "logprobs")
            logprobs = top is not None
            top = top or 0
            if top > 5:
                raise APIError(400, f"logprobs must be from 0 to 5, got {top}", "logprobs")
        if top > MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
        stop_ids = body.get("stop_token_ids") or []
        try:
            return SamplingOptions(
                temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
                top_k=_integer(body, "top_k", 0), seed=_integer(body, "seed"),
                presence_penalty=_number(body, "presence_penalty", 0.0),
                frequency_penalty=_number(body, "frequency_penalty", 0.0), max_tokens=max_tokens,
                stop=_stop(body), stop_token_ids=tuple(stop_ids) if isinstance(stop_ids, list) else stop_ids,
                logprobs=logprobs, top_logprobs=top, ignore_eos=_boolean(body, "ignore_eos", False))
        except SamplingError as err:
            field = str(err).split(" ", 1)[0].rstrip("[]")
            raise APIError(400, str(err), field) from None

    async def grammar(self, body: dict):
        """The request's JsonGrammar (None without response_format or with type text); the
        schema compiles in a worker thread (a large vocabulary takes a while the first time)."""
        fmt = body.get("response_format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise APIError(422, "response_format must be an object with a 'type'", "response_format", "invalid_type")
        kind = fmt["type"]
        if kind == "text":
            return None
        schema = None
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError(400, "response_format.json_schema must be an object with a 'schema' object",
                               "response_format")
            schema = spec.get("schema", {})
        elif kind != "json_object":
            raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                           "response_format")
        try:
            return await asyncio.to_thread(self._json_grammar, schema)
        except GrammarError as err:
            raise APIError(400, f"response_format: {err}", "response_format") from None

    def _json_grammar(self, schema: dict | None):
        with self._grammars_lock:
            if self.grammars is None:
                runner = self.engine.runner
                self.grammars = JsonGrammars(self.tokenizer, runner.vocab_size, runner.stop_ids)
        return self.grammars.matcher(self.grammars.compile(schema))

    def submit(self, tokens: list[int], options: SamplingOptions, body: dict, grammar):
        speculative = _boolean(body, "speculative", False)
        try:
            return self.engine.submit(tokens, options, speculative=speculative, grammar=grammar,
                                      loop=asyncio.get_running_loop())
        except RequestError as err:
            code = {413: "context_length_exceeded", 429: "rate_limit_exceeded", 503: "server_shutting_down"}
            kind = {429: "rate_limit_error", 503: "server_error"}.get(err.status, "invalid_request_error")
            raise APIError(err.status, str(err), err.param, code.get(err.status), kind) from None

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def usage(self, output) -> dict:
        return {"prompt_tokens": output.prompt_tokens, "completion_tokens": output.completion_tokens,
                "total_tokens": output.prompt_tokens + output.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": output.cached_tokens}}

    # -------------------------------------------------------------- logprobs
    def chat_logprobs(self, records) -> dict | None:
        if records is None:
            return None

        def entry(token, logprob):
            text = self.token_text(token)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

        return {"content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                            for r in records]}

    def completion_logprobs(self, records, offset: int = 0) -> dict | None:
        if records is None:
            return None
        tokens = [self.token_text(r.token) for r in records]
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": [_finite(r.logprob) for r in records],
                "top_logprobs": [{self.token_text(t): _finite(lp) for t, lp in r.top} for r in records],
                "text_offset": offsets}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


async def _watch_disconnect(request: Request, engine: Engine, handle) -> None:
    """Cancel the engine request when the client goes away (non-streaming requests)."""
    while not handle.finished:
        if await request.is_disconnected():
            engine.cancel(handle)
            return
        await asyncio.sleep(0.1)


def create_app(engine: Engine, model_name: str, api_key: str | None = None, drain_grace_s: float = 30.0) -> FastAPI:
    """The FastAPI app over a started engine (the caller starts and drains it). drain_grace_s:
    how long a stream may go on once the server shuts down (sse-starlette would end it at once)."""
    app = FastAPI(title="tvmattn", docs_url=None, redoc_url=None, openapi_url=None)
    state = Server(engine, model_name, api_key)
    app.state.server = state

    @app.exception_handler(APIError)
    async def api_error(_request: Request, err: APIError):
        return error_response(err.status, err.message, err.param, err.code, err.kind)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, err: Exception):
        return error_response(500, f"internal error: {type(err).__name__}: {err}", kind="server_error")

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return error_response(503, f"the engine stopped: {engine.error}", kind="server_error")
        if not engine.accepting:
            return error_response(503, "the server is shutting down", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        state.check_auth(request)
        body = await asyncio.to_thread(state.metrics.render)  # waits for the step in flight
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": state.created,
                                             "owned_by": "tvmattn"}]}

    @app.get("/v1/models/{name}")
    async def model(name: str, request: Request):
        state.check_auth(request)
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist", "model", "model_not_found")
        return {"id": model_name, "object": "model", "created": state.created, "owned_by": "tvmattn"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        state.check_auth(request)
        body = await state.body(request)
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids", "messages")
        try:
            messages = normalize_messages(body.get("messages"))
            text = render_messages(state.template, messages)
        except PromptError as err:
            raise APIError(400, str(err), err.param) from None
        tokens = state.tokenizer.encode(text, add_special_tokens=False).ids
        return await respond(request, body, tokens, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        state.check_auth(request)
        body = await state.body(request)
        if _boolean(body, "echo", False):
            raise APIError(400, "echo is not supported", "echo")
        if "suffix" in body and body["suffix"]:
            raise APIError(400, "suffix is not supported", "suffix")

        def encode(text: str) -> list[int]:
            if state.tokenizer is None:
                raise PromptError("this model has no tokenizer: send token ids", "prompt")
            return state.tokenizer.encode(text).ids

        try:
            tokens = completion_prompt(body.get("prompt"), encode)
        except PromptError as err:
            raise APIError(400, str(err), err.param) from None
        return await respond(request, body, tokens, chat=False)

    async def respond(request: Request, body: dict, tokens: list[int], chat: bool):
        """Submit the prompt tokens; a stream of server-sent events, or the whole answer."""
        options = state.options(body, len(tokens), chat=chat)
        grammar = await state.grammar(body)
        stream = _boolean(body, "stream", False)
        usage_in_stream = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        handle = state.submit(tokens, options, body, grammar)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if stream:
            events = (_chat_stream if chat else _completion_stream)(state, handle, rid, created, usage_in_stream)
            return EventSourceResponse(events, ping=15, send_timeout=30, shutdown_grace_period=drain_grace_s)
        watcher = asyncio.create_task(_watch_disconnect(request, engine, handle))
        try:
            async for _event in handle.stream:
                pass
        finally:
            watcher.cancel()
            if not handle.finished:
                engine.cancel(handle)
        output = handle.stream.output
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
                      "logprobs": state.chat_logprobs(output.logprobs)}
        else:
            choice = {"index": 0, "text": output.text, "logprobs": state.completion_logprobs(output.logprobs)}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [{**choice, "finish_reason": _reason(output.finish_reason)}],
                "usage": state.usage(output)}

    return app


def _reason(reason: str) -> str | None:
    return {"stop": "stop", "length": "length", "cancelled": None, "error": None}.get(reason, reason)


async def _chat_stream(state: Server, handle, rid: str, created: int, include_usage: bool):
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}

    def chunk(delta: dict, finish=None, logprobs=None) -> str:
        return json.dumps({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                "finish_reason": finish}]})

    try:
        yield {"data": chunk({"role": "assistant", "content": ""})}
        async for event in handle.stream:
            logprobs = state.chat_logprobs(event.logprobs) if event.logprobs else None
            if event.text or logprobs:
                yield {"data": chunk({"content": event.text}, logprobs=logprobs)}
            if event.finish_reason is not None:
                if event.finish_reason == "error":
                    yield {"data": json.dumps({"error": {"message": "the engine failed", "type": "server_error",
                                                         "param": None, "code": None}})}
                    break
                yield {"data": chunk({}, _reason(event.finish_reason))}
                if include_usage:
                    yield {"data": json.dumps({**base, "choices": [], "usage": state.usage(event.output)})}
        yield {"data": "[DONE]"}
    finally:
        if not handle.finished:
            state.engine.cancel(handle)


async def _completion_stream(state: Server, handle, rid: str, created: int, include_usage: bool):
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    offset = 0
    try:
        async for event in handle.stream:
            logprobs = state.completion_logprobs(event.logprobs, offset) if event.logprobs else None
            if event.text or logprobs or event.finish_reason is not None:
                if event.finish_reason == "error":
                    yield {"data": json.dumps({"error": {"message": "the engine failed", "type": "server_error",
                                                         "param": None, "code": None}})}
                    break
                yield {"data": json.dumps({**base, "choices": [{"index": 0, "text": event.text, "logprobs": logprobs,
                                                                "finish_reason": _reason(event.finish_reason)
                                                                if event.finish_reason else None}]})}
                offset += len(event.text)
            if event.finish_reason is not None and include_usage:
                yield {"data": json.dumps({**base, "choices": [], "usage": state.usage(event.output)})}
        yield {"data": "[DONE]"}
    finally:
        if not handle.finished:
            state.engine.cancel(handle)
