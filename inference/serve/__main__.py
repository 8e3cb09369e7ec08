"""Serve a model (and its heads) over an OpenAI-compatible API, decoding the requests that arrive as one batch.

python -m inference.serve --heads checkpoints/smollm2-135m-instruct-eagle --dtype auto --batch-size 8 --port 8000
curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "Name three rivers."}], "temperature": 0, "max_tokens": 64}'

Endpoints: /v1/completions, /v1/chat/completions (streamed with "stream": true), /v1/models, /health, /metrics.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from ..cli import run


def positive(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m inference.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="hub id or directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--heads", default=None, help="a head checkpoint directory (EAGLE, Medusa or early exit)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "auto"],
        help="float32 (default) is exact; auto picks bfloat16 where this machine computes it faster",
    )
    parser.add_argument(
        "--tree",
        default=None,
        help="auto (default: sized to this machine for --batch-size rows, see inference.calibrate); or EAGLE: "
        "depth,top_k,nodes; Medusa: nodes",
    )
    parser.add_argument("--no-lookup", action="store_true", help="do not merge prompt-lookup drafts into the tree")
    parser.add_argument("--no-fallback", action="store_true", help="draft at every step, even where it does not pay")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compiled target passes (built once a machine, then loaded in seconds)",
    )
    parser.add_argument("--batch-size", type=positive, default=8, help="rows decoding at once (default 8)")
    parser.add_argument(
        "--queue-size", type=positive, default=64, help="requests waiting for a row at most; one more gets a 429"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the model's name in requests and /v1/models")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)

    import uvicorn

    from heads import load_heads

    from ..__main__ import parse_tree
    from ..target import load_target
    from . import server_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, tokenizer = load_target(args.model, dtype=args.dtype, compile=args.compile)
    heads = load_heads(args.heads, model) if args.heads else None
    tree = None if args.tree in (None, "auto") else parse_tree(args.tree, heads, model)
    app = server_app(
        model,
        tokenizer,
        heads,
        tree=tree,
        lookup=False if args.no_lookup else None,
        fallback=not args.no_fallback,
        batch_size=args.batch_size,
        queue_size=args.queue_size,
        name=args.served_model_name,
        decoding_thread=False,
    )
    # one log line a request is the server's own (logger inference.serve), not uvicorn's access log
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    server, batcher = uvicorn.Server(config), app.state.batcher

    def serve_http():
        try:
            server.run()
        finally:  # the decode loop ends with the server (also when it could not start)
            batcher.stop()

    http = threading.Thread(target=serve_http, name="specheads-http", daemon=True)
    # uvicorn handles no signal off the main thread: SIGTERM shuts the server down gracefully here (Ctrl-C too,
    # through KeyboardInterrupt)
    signal.signal(signal.SIGTERM, lambda number, frame: setattr(server, "should_exit", True))
    http.start()
    try:  # the decode loop on the main thread, which did the loading's torch work (Batcher's own_thread says why)
        batcher.run()
    finally:
        server.should_exit = True
        http.join()
    if not server.started:
        raise SystemExit(f"the server did not start on {args.host}:{args.port} (its log above says why)")


if __name__ == "__main__":
    run(main, "python -m inference.serve")
