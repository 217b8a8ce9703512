"""A real S3 endpoint on 127.0.0.1 for tests: moto's server mode in a subprocess, and an
HTTP proxy in front of it that injects faults (5xx answers, slow answers, connections cut
mid-request) on the requests a rule picks."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vllm_hidden.warmup import free_port


class MotoServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        t0 = time.monotonic()
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() - t0 > 60:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class FaultyProxy:
    """Forwards to `upstream`; `rule(method, path, n)` (n counts requests) returns None to
    pass the request on, or one of ("status", code), ("slow", seconds), ("cut",) to answer
    with that status, answer late, or close the connection after reading half the body."""

    def __init__(self, upstream_port: int, rule, port: int = 0) -> None:
        self.rule = rule
        self.count = 0
        self.injected: list[tuple[str, str, tuple]] = []
        self.conns: set[socket.socket] = set()  # open client connections (keep-alive)
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def setup(self):
                super().setup()
                with lock:
                    proxy.conns.add(self.connection)

            def finish(self):
                with lock:
                    proxy.conns.discard(self.connection)
                super().finish()

            def _any(self):
                with lock:
                    proxy.count += 1
                    n = proxy.count
                length = int(self.headers.get("Content-Length") or 0)
                action = proxy.rule(self.command, self.path, n)
                if action and action[0] == "cut":
                    self.rfile.read(length // 2)
                    proxy.injected.append((self.command, self.path, action))
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                body = self.rfile.read(length) if length else None
                if action and action[0] == "status":
                    proxy.injected.append((self.command, self.path, action))
                    msg = b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                    self.send_response(action[1])
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if action and action[0] == "slow":
                    proxy.injected.append((self.command, self.path, action))
                    time.sleep(action[1])
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # a HEAD answer has no body but states the object's length
                self.send_header("Content-Length", r.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)  # a given port: a restart
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()  # the port is free for a restart
        for c in list(self.conns):  # and kept-alive connections end too, as when a server goes away
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def s3_env() -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true"}


def set_s3_env() -> None:
    os.environ.update(s3_env())
