"""An HTTP server on loopback for image-URL tests: an image, errors, redirects, a slow drip, and a
record of every request it saw (so a test can assert that a refused URL was never fetched)."""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DRIP_INTERVAL_S = 0.2
_DRIP_MAX_S = 120.0  # a drip never outlives a broken test by much


class MediaServer:
    """Routes: /img.png, /missing (404), /big (Content-Length over most caps), /big-unsized (64 KiB,
    no length), /redirect?to=URL (302), /redirect-loop, /drip (headers, then one byte every 0.2 s
    until the client leaves)."""

    def __init__(self, image: bytes, host: str = "127.0.0.1") -> None:
        self.image = image
        self.hits: Counter[str] = Counter()
        self.drips_open = 0
        self._lock = threading.Lock()
        media = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                url = urllib.parse.urlsplit(self.path)
                with media._lock:
                    media.hits[url.path] += 1
                if url.path == "/img.png":
                    self._send(200, media.image, "image/png")
                elif url.path == "/big":
                    self._send(200, b"\0" * 4096)
                elif url.path == "/big-unsized":
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(b"\0" * 65536)
                    self.close_connection = True
                elif url.path == "/redirect":
                    self._redirect(urllib.parse.parse_qs(url.query)["to"][0])
                elif url.path == "/redirect-loop":
                    self._redirect("/redirect-loop")
                elif url.path == "/drip":
                    self._drip()
                else:
                    self._send(404, b"not found")

            def _send(self, status: int, payload: bytes, ctype: str = "application/octet-stream") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _redirect(self, location: str) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _drip(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(media.image)))
                self.end_headers()
                with media._lock:
                    media.drips_open += 1
                try:
                    deadline = time.monotonic() + _DRIP_MAX_S
                    for byte in media.image:
                        if time.monotonic() > deadline:
                            break
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(DRIP_INTERVAL_S)
                except OSError:
                    pass  # the client went away: what the tests wait for
                finally:
                    with media._lock:
                        media.drips_open -= 1
                self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # clients hanging up mid-body is the point of several tests

        self.httpd = Quiet((host, 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
