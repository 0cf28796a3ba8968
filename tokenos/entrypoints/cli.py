"""The `tokenos` command: `generate`, `serve` and
`bench {throughput,serve,scheduler,hybrid,kernels,structured}`."""

from __future__ import annotations

import argparse
import logging
import sys


def _generate(argv: list[str]) -> int:
    from tokenos.engine.flags import add_engine_args, engine_kwargs, parse_args

    parser = argparse.ArgumentParser(
        prog="tokenos generate", description="Answer one prompt with the chat template."
    )
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-chat", action="store_true", help="complete the raw text instead of chatting")
    add_engine_args(parser)
    parser.set_defaults(dtype="auto")
    args = parse_args(parser, argv)

    from tokenos import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    kwargs.setdefault("max_model_len", 4096)
    llm = LLM(args.model, **kwargs)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    if args.no_chat:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    print(out.outputs[0].text.strip())
    return 0


def _serve(argv: list[str]) -> int:
    from tokenos.entrypoints.openai.api_server import main as serve_main

    return serve_main(argv) or 0


def _bench(argv: list[str]) -> int:
    kinds = {
        "throughput": "tokenos.bench.throughput",
        "serve": "tokenos.bench.serve",
        "scheduler": "tokenos.bench.scheduler",
        "hybrid": "tokenos.bench.hybrid",
        "families": "tokenos.bench.families",
        "kernels": "tokenos.bench.kernels",
        "structured": "tokenos.bench.structured",
    }
    if not argv or argv[0] not in kinds:
        print(f"usage: tokenos bench {{{','.join(kinds)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(kinds[argv[0]])
    return module.main(argv[1:]) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    commands = {"generate": _generate, "serve": _serve, "bench": _bench}
    if not argv or argv[0] not in commands:
        print("usage: tokenos {generate,serve,bench} ...", file=sys.stderr)
        return 2
    try:
        return commands[argv[0]](argv[1:])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
