"""The flags of `tokenos serve [MODEL]`: the server's own (`SERVER_FLAGS`), then the engine's
(`tokenos.engine.flags`, one EngineArgs field each), and vLLM's flags that tokenos accepts or refuses.

MODEL is optional (the embedded SmolLM2 when omitted) and may also be given as `--model`.
`python -m tokenos.entrypoints.openai.cli_args --markdown` prints the README's flag table.
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenos.engine.args import EngineArgs
from tokenos.engine.flags import (
    Flag,
    add_engine_args,
    add_flags,
    engine_kwargs,
    json_list,
    markdown_table,
    parse_args,
)
from tokenos.tool_parsers import TOOL_PARSERS


def lora_module(value: str) -> dict:
    """``name=path`` or vLLM's JSON form -> {"name", "path", "base_model_name"}."""
    text = value.strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(parsed, dict) or not {"name", "path"} <= set(parsed):
            raise argparse.ArgumentTypeError('expected {"name": ..., "path": ...}')
        return {
            "name": str(parsed["name"]),
            "path": str(parsed["path"]),
            "base_model_name": parsed.get("base_model_name"),
        }
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {value!r}")
    return {"name": name, "path": path, "base_model_name": None}


SERVER_FLAGS: tuple[Flag, ...] = (
    Flag(
        ("--lora-modules",),
        "lora_modules",
        "LoRA adapters to serve (with --enable-lora): name=path, or vLLM's JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; clients pick one as `model`',
        type=lora_module,
        nargs="+",
    ),
    Flag(("--host",), "host", "address to listen on (127.0.0.1; 0.0.0.0 for all)", default="127.0.0.1"),
    Flag(("--port",), "port", "port to listen on (8000)", type=int, default=8000),
    Flag(("--api-key",), "api_key", "require `Authorization: Bearer KEY` on every route but the probes"),
    Flag(("--root-path",), "root_path", "the path prefix a proxy serves the app under (ASGI root_path)"),
    Flag(
        ("--allowed-origins",),
        "allowed_origins",
        'CORS: allowed origins, a JSON list (["*"])',
        type=json_list,
        default=["*"],
    ),
    Flag(
        ("--allowed-methods",),
        "allowed_methods",
        'CORS: allowed methods, a JSON list (["*"])',
        type=json_list,
        default=["*"],
    ),
    Flag(
        ("--allowed-headers",),
        "allowed_headers",
        'CORS: allowed headers, a JSON list (["*"])',
        type=json_list,
        default=["*"],
    ),
    Flag(("--allow-credentials",), "allow_credentials", "CORS: allow credentials", action="store_true"),
    Flag(("--ssl-keyfile",), "ssl_keyfile", "TLS: the private key file (with --ssl-certfile)"),
    Flag(("--ssl-certfile",), "ssl_certfile", "TLS: the certificate file"),
    Flag(("--ssl-ca-certs",), "ssl_ca_certs", "TLS: CA certificates to check clients against"),
    Flag(
        ("--uvicorn-log-level",),
        "uvicorn_log_level",
        "uvicorn's log level (info)",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        default="info",
    ),
    Flag(
        ("--max-request-body-bytes",),
        "max_request_body_bytes",
        "refuse (413) request bodies larger than this, before reading them (4 MiB)",
        type=int,
        default=4 << 20,
    ),
    Flag(
        ("--enable-docs",),
        "enable_docs",
        "serve the OpenAPI schema and the /docs and /redoc pages (off)",
        action="store_true",
    ),
    Flag(
        ("--enable-auto-tool-choice",),
        "enable_auto_tool_choice",
        'tool_choice "auto" (the default with tools): read tool calls out of the model\'s text',
        action="store_true",
    ),
    Flag(
        ("--tool-call-parser",),
        "tool_call_parser",
        "the format the model writes tool calls in (with --enable-auto-tool-choice): "
        + ", ".join(sorted(TOOL_PARSERS)),
        choices=sorted(TOOL_PARSERS),
    ),
    Flag(("--response-role",), "response_role", "the role of chat replies (assistant)", default="assistant"),
    Flag(
        ("--return-tokens-as-token-ids",),
        "return_tokens_as_token_ids",
        'logprobs name tokens as "token_id:N" (for tokens that are not valid UTF-8 alone)',
        action="store_true",
    ),
    Flag(
        ("--enable-prompt-tokens-details",),
        "enable_prompt_tokens_details",
        "usage carries prompt_tokens_details (cached_tokens)",
        action="store_true",
    ),
    Flag(
        ("--enable-log-requests",),
        "enable_log_requests",
        "log a line per request received and finished",
        action="store_true",
    ),
)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    add_flags(parser, SERVER_FLAGS)
    add_engine_args(parser)
    parser.set_defaults(dtype=EngineArgs.dtype)
    return parser


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenos serve", description="OpenAI-compatible HTTP server.")
    return add_serve_args(parser)


def parse_serve_args(argv: list[str] | None) -> argparse.Namespace:
    args = parse_args(make_parser(), argv)
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise SystemExit(f"tokenos serve: MODEL ({args.model_tag}) and --model ({args.model}) disagree")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("tokenos serve: --enable-auto-tool-choice needs --tool-call-parser NAME")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise SystemExit("tokenos serve: --ssl-keyfile and --ssl-certfile go together")
    if args.lora_modules and not args.enable_lora:
        raise SystemExit("tokenos serve: --lora-modules needs --enable-lora")
    args.model = args.model_tag or args.model
    return args


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The EngineArgs the parsed flags describe."""
    return EngineArgs(model=args.model, **engine_kwargs(args))


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown_table(SERVER_FLAGS), end="")
