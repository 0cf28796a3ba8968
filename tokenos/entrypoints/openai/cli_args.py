"""The flags of `tokenos serve [MODEL]`: the server's own, then the engine's (one EngineArgs field each).

MODEL is optional (the embedded SmolLM2 when omitted) and may also be given as `--model`.
"""

from __future__ import annotations

import argparse

from tokenos.engine.args import EngineArgs, add_engine_args, engine_kwargs
from tokenos.tool_parsers import TOOL_PARSERS


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: MODEL's)"
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, a file holding one, or a shipped one by name (chatml_tools: ChatML "
        "with tools in the hermes format, for models whose own template has none)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default with tools): read tool calls out of the model\'s text',
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the format the model writes tool calls in (with --enable-auto-tool-choice)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 << 20,
        help="refuse (413) request bodies larger than this, before reading them",
    )
    parser.add_argument(
        "--enable-docs",
        action="store_true",
        help="serve the OpenAPI schema and the /docs and /redoc pages (off by default)",
    )
    add_engine_args(parser)
    parser.set_defaults(dtype=EngineArgs.dtype)
    return parser


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenos serve", description="OpenAI-compatible HTTP server.")
    return add_serve_args(parser)


def parse_serve_args(argv: list[str] | None) -> argparse.Namespace:
    args = make_parser().parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("tokenos serve: --enable-auto-tool-choice needs --tool-call-parser NAME")
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise SystemExit(f"tokenos serve: MODEL ({args.model_tag}) and --model ({args.model}) disagree")
    args.model = args.model_tag or args.model
    return args


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The EngineArgs the parsed flags describe."""
    return EngineArgs(model=args.model, **engine_kwargs(args))
