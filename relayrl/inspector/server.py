"""``relayrl inspect``: the page served from one process on 127.0.0.1, or written as static files.

The page (``static/``: HTML, CSS and vanilla JavaScript, no third-party assets) ships inside the
package, so it works offline. Served, the data are JSON made per request from the run directories
(a step file is read when its step is opened), answered only to this server's own Host and never to
another site's page (``utils.webguard``: DNS rebinding, cross-site reads); exported, every step's
data is a script written next to the page, which then opens from ``file://`` with no server.
"""

from __future__ import annotations

import re
import shutil
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from relayrl.inspector.data import manifest_json, manifest_script, step_json, step_path, step_script
from relayrl.utils.rollouts import read_index
from relayrl.utils.webguard import refusal

STATIC = Path(__file__).parent / "static"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css",
    ".json": "application/json",
}
STEP_URL = re.compile(r"^/data/r(\d+)/step_(\d+)\.json$")
MAX_DIGITS = 12  # longer run / step numbers are a 400 (int() of 5,000 digits raises)


def make_server(run_dirs: list[Path], host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server for the page over ``run_dirs`` (port 0 picks a free one); call ``serve_forever``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            why = refusal({k.lower(): v for k, v in self.headers.items()}, host)
            if why is not None:
                self.send_error(403, f"refused: {why}")
                return
            path = self.path.split("?", 1)[0]
            body: str | None = None
            if path == "/":
                path = "/index.html"
            if path == "/data/manifest.json":
                body = manifest_json(run_dirs)
            elif m := STEP_URL.match(path):
                if max(len(m.group(1)), len(m.group(2))) > MAX_DIGITS:
                    self.send_error(400, f"run or step number over {MAX_DIGITS} digits")
                    return
                body = step_json(run_dirs, int(m.group(1)), int(m.group(2)))
            elif (STATIC / path.lstrip("/")).is_file() and "/" not in path.lstrip("/"):
                body = (STATIC / path.lstrip("/")).read_text()
            if body is None:
                self.send_error(404, f"not found: {path}")
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", TYPES.get(Path(path).suffix, "application/octet-stream"))
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")  # a run still training writes new steps
            self.send_header("X-Content-Type-Options", "nosniff")  # JSON is never run as a script
            self.send_header("Cross-Origin-Resource-Policy", "same-origin")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
            pass  # one line per request would drown the URL the user needs

    return ThreadingHTTPServer((host, port), Handler)


def export(run_dirs: list[Path], out: Path) -> Path:
    """Write the page and every saved step's data under ``out``; returns ``out/index.html``."""
    out.mkdir(parents=True, exist_ok=True)
    for asset in STATIC.iterdir():
        if asset.is_file():
            shutil.copyfile(asset, out / asset.name)
    (out / "data").mkdir(exist_ok=True)
    (out / "data" / "manifest.js").write_text(manifest_script(run_dirs))
    for r, run_dir in enumerate(run_dirs):
        for entry in read_index(run_dir):
            step = int(str(entry["step"]))
            body = step_script(run_dirs, r, step)
            if body is not None:
                target = out / step_path(r, step)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(body)
    return out / "index.html"
