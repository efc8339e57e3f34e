"""``hicache router`` start-up: seconds from process start until /health answers, and RSS.

Usage: python scripts/router_startup.py [--runs 5] [LABEL=SRC_DIR ...]

Each LABEL=SRC_DIR is a checkout's ``src`` put first on PYTHONPATH (default: this
checkout's, labelled "current"); the runs alternate between them so that a
machine's drift in load touches each alike. A fake worker (a thread here) answers
every GET with the smallest /get_server_info the router accepts, so the router
discovers it, builds its app and serves; ready is the first HTTP answer to the
router's /health (200 or 503: either means the app is up). RSS is read from
/proc at that moment (VmRSS) with its peak so far (VmHWM); "torch" says whether
libtorch is mapped into the process. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_READY_TIMEOUT_S = 60.0
_POLL_S = 0.01
_INFO = {"page_size": 16, "served_model_name": "fake-model"}


class _FakeWorker(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps(_INFO).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        connection.request("GET", "/health")
        connection.getresponse().read()
        return True
    except OSError:
        return False
    finally:
        connection.close()


def _proc_status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def measure(src: str, worker_url: str) -> dict[str, float | bool]:
    """One start of the router with ``src`` first on the path, stopped once ready."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": src}
    command = [sys.executable, "-m", "hicache", "--log-level", "warning", "router",
               "--worker-urls", worker_url, "--host", "127.0.0.1", "--port", str(port)]
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        while not _answers(port):
            if process.poll() is not None:
                raise RuntimeError(f"the router exited with {process.returncode}")
            if time.perf_counter() - started > _READY_TIMEOUT_S:
                raise RuntimeError("the router did not answer /health in time")
            time.sleep(_POLL_S)
        ready_s = time.perf_counter() - started
        maps = Path(f"/proc/{process.pid}/maps").read_text()
        return {
            "ready_s": ready_s,
            "rss_mib": _proc_status_kib(process.pid, "VmRSS") / 1024,
            "peak_rss_mib": _proc_status_kib(process.pid, "VmHWM") / 1024,
            "torch": "libtorch" in maps,
        }
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("sources", nargs="*", metavar="LABEL=SRC_DIR")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1] / "src")
    sources = [s.split("=", 1) for s in args.sources] or [["current", here]]
    worker = ThreadingHTTPServer(("127.0.0.1", 0), _FakeWorker)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    worker_url = f"http://127.0.0.1:{worker.server_address[1]}"
    results: dict[str, list[dict[str, float | bool]]] = {label: [] for label, _ in sources}
    for run in range(args.runs):
        for label, src in sources:
            result = measure(src, worker_url)
            results[label].append(result)
            print(f"run {run + 1} {label}: ready {result['ready_s']:.2f} s, "
                  f"RSS {result['rss_mib']:.0f} MiB (peak {result['peak_rss_mib']:.0f}), "
                  f"torch {'loaded' if result['torch'] else 'not loaded'}", flush=True)
    worker.shutdown()
    for label, runs in results.items():
        ready = [float(r["ready_s"]) for r in runs]
        rss = [float(r["rss_mib"]) for r in runs]
        print(f"{label}: ready median {statistics.median(ready):.2f} s "
              f"(min {min(ready):.2f}, max {max(ready):.2f}); "
              f"RSS median {statistics.median(rss):.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
