"""`captioner serve`: the page and the HTTP API (captioner.serve) on uvicorn."""
from __future__ import annotations

import argparse
import socket
from pathlib import Path

from captioner.cli.common import (add_decode_options, add_device, add_runtime, check_range, decode_overrides,
                                  load_captioner, refuse_empty_paths)
from captioner.errors import CaptionerError

MAX_MB = 1024.0  # an upload is held in memory whole
MAX_DELAY_MS = 10_000.0  # how long a lone request may wait for company: 10 s is already far past any use


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="a web page and HTTP API: captions and where the model looked, word by word",
                       description="Serve the page (/) and the API (/api/caption, /api/health, /api/model; "
                                   "docs at /docs) for one model.")
    add_device(p)
    add_decode_options(p, bundled=True)
    add_runtime(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine "
                                                       "only; 0.0.0.0 for every network)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--max-mb", type=float, default=20.0, help=f"largest upload in MB, at most {MAX_MB:g} (default 20)")
    p.add_argument("--max-pixels", type=int, default=50_000_000, help="largest image in pixels (default 50M)")
    p.add_argument("--max-batch", type=int, default=16, help="most requests captioned in one batch (default 16)")
    p.add_argument("--max-delay-ms", type=float, default=5.0,
                   help=f"how long the first waiting request waits for others to join its batch, 0 to "
                        f"{MAX_DELAY_MS:g} (default 5)")
    p.add_argument("--examples", metavar="DIR",
                   help="example images to offer on the page (default: the drawn shapes for a model trained on "
                        "the built-in shapes set, none for any other)")
    p.set_defaults(func=run)


def _listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket, so a busy port fails before the model loads (and port 0 works)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        return sock
    except OSError as e:
        raise CaptionerError(f"{host}:{port}: cannot listen there ({e.strerror or e})") from None


def _trained_on(args: argparse.Namespace) -> str:
    """The data.path of the (first) model's training config: "shapes" for the built-in set."""
    if args.runtime == "onnx":
        from captioner.deploy.runtime import exported_data

        try:
            return exported_data(args.checkpoint[0]).path
        except CaptionerError:  # an export older than the manifest's data settings: a model of unknown data
            return ""
    from captioner.model.checkpoint import load_checkpoint

    return load_checkpoint(args.checkpoint[0]).config.data.path


def _examples(args: argparse.Namespace) -> dict[str, Path]:
    from captioner.serve.page import examples_for

    return examples_for(_trained_on(args), None if args.examples is None else Path(args.examples))


def _check(args: argparse.Namespace) -> None:
    """The serving settings, checked before any work: one line for the first that does not fit (nan and inf
    never do)."""
    check_range("--port", args.port, "[0, 65535]")
    check_range("--max-mb", args.max_mb, f"(0, {MAX_MB:g}]")
    check_range("--max-pixels", args.max_pixels, ">= 1")
    check_range("--max-batch", args.max_batch, ">= 1")
    check_range("--max-delay-ms", args.max_delay_ms, f"[0, {MAX_DELAY_MS:g}]")
    refuse_empty_paths([("--examples", args.examples)])  # '' (an unset variable) is not the current folder
    if args.examples is not None and not Path(args.examples).is_dir():
        raise CaptionerError(f"--examples {args.examples}: not a folder")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from captioner.serve.app import Limits, create_app

    _check(args)
    settings = decode_overrides(args)
    sock = _listen(args.host, args.port)
    captioner = load_captioner(args)
    captioner.decode = captioner.decode_config(**settings)
    limits = Limits(max_bytes=int(args.max_mb * 2**20), max_pixels=args.max_pixels)
    app = create_app(captioner, " ".join(args.checkpoint), limits, args.max_batch, args.max_delay_ms,
                     _examples(args))
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {' + '.join(args.checkpoint)} at http://{shown}:{port}/  (API docs at /docs; Ctrl-C to stop)",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn has shut down (requests answered, model thread stopped), then re-raises
        pass
    print("stopped", flush=True)
    return 0
