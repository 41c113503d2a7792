"""Latency and throughput of `captioner serve` under 1, 4 and 16 concurrent clients.

Starts the server as a user does (`captioner serve --port 0`), then each level sends a bounded
number of requests (real JPEGs from the data set, in a fixed order) from N client threads on the
loopback address, each client waiting for its answer before sending the next. Prints p50/p95
latency, images/s and failures per level, and the ratio of 16-client throughput to 1-client.
Targets (2-core CPU): p50 under 150 ms with one client; 16 clients at least 1.5x one client's
images/s; no failed request.

    python scripts/bench_serve.py --checkpoint runs/flickr8k-800/best.pt --images ../shared/data/flickr8k-800/Images
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import Server  # noqa: E402


def run_level(url: str, images: list[bytes], clients: int, requests: int) -> dict[str, float]:
    latencies: list[float] = []
    failures = 0
    lock = threading.Lock()
    counter = iter(range(requests))

    def client() -> None:
        nonlocal failures
        with httpx.Client(timeout=60) as http:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                tick = time.perf_counter()
                try:
                    ok = http.post(f"{url}api/caption", content=images[i % len(images)],
                                   headers={"content-type": "image/jpeg"}).status_code == 200
                except httpx.HTTPError:
                    ok = False
                with lock:
                    latencies.append(time.perf_counter() - tick)
                    failures += not ok

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    quantiles = statistics.quantiles(latencies, n=20)
    return {"clients": clients, "requests": len(latencies), "p50_ms": 1000 * statistics.median(latencies),
            "p95_ms": 1000 * quantiles[18], "images_s": len(latencies) / wall, "failed": failures}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--images", default="../shared/data/flickr8k-800/Images", help="folder of JPEGs to send")
    p.add_argument("--requests", type=int, default=200, help="requests per level")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients")
    p.add_argument("--max-batch", default="16")
    p.add_argument("--max-delay-ms", default="5")
    p.add_argument("--runtime", default="torch", choices=["torch", "onnx"])
    args = p.parse_args()

    files = sorted(Path(args.images).glob("*.jpg"))[:64]
    if not files:
        p.error(f"{args.images}: no .jpg files")
    images = [f.read_bytes() for f in files]
    server = Server(Path(args.checkpoint), "--max-batch", args.max_batch, "--max-delay-ms", args.max_delay_ms,
                    "--runtime", args.runtime, timeout=300)
    try:
        run_level(server.url, images, 2, 20)  # warm up: first-call allocations, thread pools
        rows = [run_level(server.url, images, n, args.requests) for n in args.levels]
    finally:
        server.stop()
    print(f"{args.runtime}, max batch {args.max_batch}, max delay {args.max_delay_ms} ms")
    print(f"{'clients':>7} {'requests':>8} {'p50 ms':>8} {'p95 ms':>8} {'images/s':>9} {'failed':>6}")
    for r in rows:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['p50_ms']:>8.1f} {r['p95_ms']:>8.1f} {r['images_s']:>9.2f} "
              f"{r['failed']:>6}")
    print(f"throughput {rows[-1]['clients']} clients / {rows[0]['clients']}: "
          f"{rows[-1]['images_s'] / rows[0]['images_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
