"""The OpenAI-compatible HTTP server: a FastAPI app over an `AsyncLLM`, run by uvicorn.

`build_app(engine, args)` wires the routes to any engine with the AsyncLLM surface (tests pass a
fake one); `run_server(args)` builds the real engine (engine core in a child process), serves
until SIGINT/SIGTERM or engine death, and returns the exit code (1 when the engine died).

Every error leaves as an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`:
validation 400 (malformed JSON, wrong types, out-of-range values, prompts that do not fit),
401 (API key), 404 (unknown model or route), 413 (body over `--max-request-body-bytes`, refused
before it is read), 429 (too many requests queued, with Retry-After), 500 (the engine failed that
request alone), 503 (engine dead).

With `--api-key`, every route needs `Authorization: Bearer KEY` except the probes `/health`,
`/ping`, `/metrics` and `/version` (vLLM's set). The OpenAPI schema and the docs pages are off unless
`--enable-docs`. Nothing slow runs on the event loop: tokenization, chat templates and
detokenization go to a small thread pool, so `/health` answers while a huge prompt is being refused.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenos
from tokenos.core.validation import InvalidRequestError
from tokenos.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from tokenos.entrypoints.openai.protocol_responses import ResponsesRequest
from tokenos.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenos.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenos.entrypoints.openai.serving_engine import ClientDisconnected, ServingOptions
from tokenos.entrypoints.openai.serving_responses import OpenAIServingResponses

logger = logging.getLogger("tokenos.server")

HEALTH_POLL_S = 1.0
KV_GROUPS_TIMEOUT_S = 2.0
# Routes that answer without the API key: probes a load balancer or Prometheus calls.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
# Threads that tokenize / render / detokenize for the HTTP layer, off the event loop.
FRONT_DOOR_THREADS = 2


class BodySizeLimit:
    """ASGI middleware: refuse a body over ``max_bytes`` with 413, before reading it when it declares its
    Content-Length, else as soon as it grows past the limit (the body is gathered here, then replayed to
    the app, so the limit holds however the client streams it)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await too_large(self.max_bytes)(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await too_large(self.max_bytes)(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls: disconnect detection

        await self.app(scope, replay, send)


def too_large(max_bytes: int) -> JSONResponse:
    return error_response(
        OpenAIError(
            f"The request body is larger than this server accepts ({max_bytes} bytes; "
            "see --max-request-body-bytes).",
            status=413,
            code="request_too_large",
        )
    )


def served_model_names(engine: Any, args: argparse.Namespace) -> list[str]:
    """The names clients may use, the first answered with: --served-model-name, else MODEL as given (as
    vLLM names it), else the engine's (the embedded model's file name)."""
    names = getattr(args, "served_model_name", None)
    if isinstance(names, str):
        names = [names]
    if names:
        return list(names)
    model = getattr(args, "model", None)
    if model:
        return [model]
    if engine is not None and getattr(engine, "served_model_name", None):
        return [engine.served_model_name]
    from tokenos.model_loader.embedded import default_model_path

    return [os.path.basename(default_model_path()).removesuffix(".gguf")]


def error_response(error: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return JSONResponse(error.to_response().model_dump(), status_code=error.status, headers=headers)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(f"The request body is not valid JSON: {first.get('msg')}.")
    param = loc[0] if loc else None
    where = ".".join(loc)
    return OpenAIError(f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=param)


def build_app(engine: Any, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app serving `engine` (AsyncLLM surface) with the settings in `args`."""
    docs = bool(getattr(args, "enable_docs", False))
    app = FastAPI(
        title="tokenos",
        version=tokenos.__version__,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    names = served_model_names(engine, args)
    executor = ThreadPoolExecutor(FRONT_DOOR_THREADS, thread_name_prefix="tokenos-front-door")
    options = ServingOptions.from_args(args)
    completion = OpenAIServingCompletion(engine, names, executor, options)
    tool_parser = (
        getattr(args, "tool_call_parser", None) if getattr(args, "enable_auto_tool_choice", False) else None
    )
    chat = OpenAIServingChat(engine, names, executor, tool_call_parser=tool_parser, options=options)
    responses = OpenAIServingResponses(chat)
    max_body = getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_REQUEST_BODY_BYTES
    _add_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body)
    _add_api_key_check(app, getattr(args, "api_key", None))
    if getattr(engine, "metrics", None) is not None:
        from tokenos.entrypoints.openai.http_metrics import instrument

        instrument(app, engine.metrics.registry)
    # Outermost, as vLLM adds it: a browser's OPTIONS preflight is answered before the key is checked.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=getattr(args, "allowed_origins", None) or ["*"],
        allow_methods=getattr(args, "allowed_methods", None) or ["*"],
        allow_headers=getattr(args, "allowed_headers", None) or ["*"],
        allow_credentials=bool(getattr(args, "allow_credentials", False)),
    )

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as e:
            return error_response(OpenAIError(f"The engine is dead: {e}", status=503, code="engine_dead"))
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": tokenos.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        from tokenos.engine.metrics import CONTENT_TYPE

        source = getattr(engine, "metrics", None)
        if source is None:
            return Response(b"", media_type=CONTENT_TYPE)
        if getattr(engine, "errored", False):
            source.engine_dead.set(1)
        elif hasattr(engine, "get_kv_groups"):  # a walk over the pool: at scrape time, not every step
            try:
                source.update_kv_groups(await asyncio.wait_for(engine.get_kv_groups(), KV_GROUPS_TIMEOUT_S))
            except Exception as e:  # the rest of the metrics still answer
                logger.warning("per-group KV pages unavailable for this scrape: %s", e)
        return Response(source.render(), media_type=CONTENT_TYPE)

    root = getattr(getattr(engine, "engine_args", None), "model", None)

    def card(name: str) -> ModelCard:
        adapter = completion.lora_adapters.get(name)
        if adapter is not None:
            return ModelCard(
                id=name, root=adapter["path"], parent=names[0], max_model_len=completion.max_model_len
            )
        return ModelCard(id=name, root=root or name, max_model_len=completion.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(n) for n in [*names, *completion.lora_adapters]])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        return card(completion.check_model(model_id))

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await _respond(completion.create_completion(request, raw_request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await _respond(chat.create_chat_completion(request, raw_request))

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await _respond(responses.create_response(request, raw_request))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        completion.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give exactly one of `prompt` and `messages`.", param="prompt")
        if request.messages is not None:
            tokens = (await chat.off_loop(chat.render_prompt, request)).token_ids
        else:
            door = engine.input_processor
            tokens = await chat.off_loop(door.encode, request.prompt, request.add_special_tokens)
        return {"count": len(tokens), "max_model_len": completion.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        completion.check_model(request.model)
        return {"prompt": await chat.off_loop(engine.input_processor.decode, request.tokens)}

    if runtime_lora_updating():
        _add_lora_routes(app, engine, names)
    return app


def runtime_lora_updating() -> bool:
    """Whether clients may load and unload adapters (vLLM's guard: off unless the environment says so)."""
    flags = (
        os.environ.get(v, "")
        for v in ("TOKENOS_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    )
    return any(f.strip().lower() in ("1", "true") for f in flags)


def _add_lora_routes(app: FastAPI, engine: Any, names: list[str]) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        if request.lora_name in names:
            raise OpenAIError(f"`{request.lora_name}` is the base model's name.", param="lora_name")
        try:
            await engine.add_lora(request.lora_name, request.lora_path)
        except ValueError as e:
            raise OpenAIError(str(e), param="lora_path") from None
        return Response(
            f"Success: LoRA adapter '{request.lora_name}' added successfully.", media_type="text/plain"
        )

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        if not await engine.remove_lora(request.lora_name):
            raise OpenAIError(
                f"The lora adapter '{request.lora_name}' cannot be found.",
                status=404,
                param="lora_name",
                code="model_not_found",
            )
        return Response(
            f"Success: LoRA adapter '{request.lora_name}' removed successfully.", media_type="text/plain"
        )


async def load_lora_modules(engine: Any, modules: list[dict] | None) -> None:
    """The adapters of --lora-modules, loaded before the server answers; ValueError on a bad one."""
    for module in modules or ():
        await engine.add_lora(module["name"], module["path"])


async def _respond(pending: Any) -> Response:
    try:
        result = await pending
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return JSONResponse(result.model_dump())


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(OpenAIError(exc.message, param=exc.param))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(OpenAIError(str(exc.detail), status=exc.status_code))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s", request.url.path)
        return error_response(OpenAIError(f"Internal error: {type(exc).__name__}: {exc}", status=500))


def _add_api_key_check(app: FastAPI, api_key: str | None) -> None:
    if not api_key:
        return
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.url.path not in PUBLIC_PATHS:
            given = request.headers.get("authorization", "").encode()
            if not secrets.compare_digest(given, expected):
                return error_response(
                    OpenAIError("Incorrect API key provided.", status=401, code="invalid_api_key")
                )
        return await call_next(request)


# ------------------------------------------------------------------ running it


def build_engine(args: argparse.Namespace) -> Any:
    """The real engine: an AsyncLLM with its engine core in a child process, and its metrics."""
    from tokenos.engine.async_llm import AsyncLLM
    from tokenos.engine.metrics import EngineMetrics
    from tokenos.entrypoints.openai.cli_args import engine_args_from

    engine_args = engine_args_from(args)
    return AsyncLLM(engine_args, metrics=EngineMetrics(served_model_names(None, args)[0]))


async def serve_app(app: FastAPI, engine: Any, args: argparse.Namespace) -> int:
    """Serve until a signal (exit 0) or the engine's death (exit 1)."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=getattr(args, "uvicorn_log_level", None) or "info",
        access_log=False,
        timeout_graceful_shutdown=5,
        ssl_keyfile=getattr(args, "ssl_keyfile", None),
        ssl_certfile=getattr(args, "ssl_certfile", None),
        ssl_ca_certs=getattr(args, "ssl_ca_certs", None),
        root_path=getattr(args, "root_path", None) or "",
    )
    try:
        await load_lora_modules(engine, getattr(args, "lora_modules", None))
    except ValueError as e:
        logger.error("cannot start: %s", e)
        return 1
    server = uvicorn.Server(config)
    watchdog = asyncio.create_task(_watch_engine(server, engine, args))
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again for the handler it
    # found: let that one note it, so Ctrl-C ends with exit 0 and one line, not a KeyboardInterrupt.
    previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        await server.serve()
    finally:
        watchdog.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if getattr(engine, "errored", False) else 0


def _note_signal(signum: int, frame: Any) -> None:
    logger.info("%s received: the server has shut down", signal.Signals(signum).name)


async def _watch_engine(server: Any, engine: Any, args: argparse.Namespace) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    info = getattr(engine, "model_info", {}) or {}
    logger.info(
        "tokenos %s ready on http://%s:%d  model=%s  max_model_len=%s  KV pool=%s tokens",
        tokenos.__version__,
        args.host,
        args.port,
        served_model_names(engine, args)[0],
        engine.model_config.max_model_len,
        info.get("kv_pool_tokens", "?"),
    )
    while True:
        await asyncio.sleep(HEALTH_POLL_S)
        try:
            await engine.check_health()
        except Exception as e:
            logger.error("engine died (%s): shutting the server down", e)
            server.should_exit = True
            return


def run_server(args: argparse.Namespace) -> int:
    """Build the engine, serve, shut the engine down; returns the process exit code."""
    from tokenos.engine.core_client import EngineStartupError

    try:
        engine = build_engine(args)
    except (EngineStartupError, FileNotFoundError, ValueError) as e:
        logger.error("cannot start: %s", e)
        return 1
    try:
        return asyncio.run(serve_app(build_app(engine, args), engine, args))
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    from tokenos.entrypoints.openai.cli_args import parse_serve_args

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    return run_server(parse_serve_args(argv))


if __name__ == "__main__":
    sys.exit(main())
