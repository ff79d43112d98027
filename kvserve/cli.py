"""The ``kvserve`` command: serve, generate, chat, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvserve.config import EngineConfig
from kvserve.errors import InvalidArgumentError, KVServeError


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _sampling_params(a: argparse.Namespace):
    from kvserve import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                          presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                          seed=a.sampling_seed, stop=a.stop, ignore_eos=a.ignore_eos)


def _llm(a: argparse.Namespace):
    from kvserve.llm import LLM

    return LLM(**vars(EngineConfig.from_cli_args(a)))


def cmd_generate(a: argparse.Namespace) -> None:
    params = _sampling_params(a)
    llm = _llm(a)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")


def cmd_chat(a: argparse.Namespace) -> None:
    params = _sampling_params(a)
    llm = _llm(a)
    history: list[dict[str, str]] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print(f"kvserve chat on {llm.model_name}. Ctrl-D or /exit to leave, /reset to forget.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        answer = []
        try:
            for out in llm.stream(llm.tokenizer.apply_chat_template(history), params):
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
                answer.append(out.delta_text)
        except KeyboardInterrupt:
            pass  # stop this answer, keep the conversation
        except KVServeError as e:  # e.g. the conversation outgrew the context window
            print(f"\nerror: {e}", file=sys.stderr)
            history.pop()
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(answer)})


def cmd_serve(a: argparse.Namespace) -> None:
    from kvserve.engine.process import AsyncEngineClient
    from kvserve.server.app import ServerConfig
    from kvserve.server.launch import serve

    engine_config = EngineConfig.from_cli_args(a)
    if a.max_waiting_requests is not None and a.max_waiting_requests < 0:
        raise InvalidArgumentError("--max-waiting-requests must be at least 0", param="max_waiting_requests")
    if a.max_request_bytes is not None and a.max_request_bytes < 1:
        raise InvalidArgumentError("--max-request-bytes must be positive", param="max_request_bytes")
    if a.max_log_len < 0:
        raise InvalidArgumentError("--max-log-len must be at least 0", param="max_log_len")
    logging.basicConfig(level=getattr(logging, a.uvicorn_log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ServerConfig(served_model_names=a.served_model_name or [], api_key=a.api_key,
                          log_requests=a.log_requests, max_log_len=a.max_log_len)
    if a.max_request_bytes is not None:
        config.max_request_bytes = a.max_request_bytes
    serve(lambda: AsyncEngineClient(engine_config, max_waiting_requests=a.max_waiting_requests), config,
          a.host, a.port, graceful_shutdown_timeout=a.graceful_shutdown_timeout, log_level=a.uvicorn_log_level)


def cmd_bench_offline(a: argparse.Namespace) -> None:
    from kvserve.bench.offline import run

    run(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="A small LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model` (default: the model's folder or file name)")
    s.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $KVSERVE_API_KEY)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 429 when this many requests already wait (default: no limit)")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body, 413 above (default: 8 MiB)")
    s.add_argument("--log-requests", action="store_true",
                   help="log each request's prompt and sampling parameters (debugging; without it, logs never "
                        "hold prompt or answer text)")
    s.add_argument("--max-log-len", type=int, default=200, help="with --log-requests, prompt characters logged")
    s.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let requests in flight finish")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    EngineConfig.add_cli_args(s)
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="complete one prompt and print the answer as it streams")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    _sampling_args(g)
    EngineConfig.add_cli_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat in the terminal")
    c.add_argument("--system", default=None, help="system prompt")
    _sampling_args(c)
    EngineConfig.add_cli_args(c)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from kvserve.bench.offline import add_args

    off = bsub.add_parser("offline", help="in-process throughput on random prompts")
    add_args(off)
    off.set_defaults(func=cmd_bench_offline)

    from kvserve.bench import serve as bench_serve

    srv = bsub.add_parser("serve", help="load an OpenAI-compatible server with streaming requests")
    bench_serve.add_args(srv)
    srv.set_defaults(func=lambda a: bench_serve.run(a))

    from kvserve.bench import compare as bench_compare

    cmp = bsub.add_parser("compare", help="one serving workload against several servers in turn")
    bench_compare.add_args(cmp)
    cmp.set_defaults(func=lambda a: bench_compare.run(a))

    from kvserve.sim.cli import add_parsers as add_sim_parsers

    add_sim_parsers(sub)

    tbl = bsub.add_parser("table", help="side-by-side markdown of saved results (name=FILE.json ...)")
    tbl.add_argument("results", nargs="+", help="name=path pairs of --save-result files")
    tbl.set_defaults(func=lambda a: print(bench_compare.table(a.results)))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KVServeError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
