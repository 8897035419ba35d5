"""tests/sandboxes.py's decision before a `container` test: a Docker daemon that answers
but lacks the sandbox image skips the test on a developer's machine, naming the command that
builds the image, and fails it under CI=true. A fake Docker API on loopback plays a fresh
daemon (no images)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import sandboxes


class ImagelessDaemon(BaseHTTPRequestHandler):
    """What dockerd answers the docker package with no image pulled or built."""

    def do_GET(self):
        path = self.path.split("?")[0]
        if path.endswith("/version"):
            self.reply(200, json.dumps({"ApiVersion": "1.41", "Version": "20.10.24"}), "application/json")
        elif path.endswith("/_ping"):
            self.reply(200, "OK", "text/plain")
        else:
            self.reply(404, json.dumps({"message": f"No such image: {path}"}), "application/json")

    def reply(self, status: int, body: str, content_type: str):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def imageless_daemon(monkeypatch):
    """DOCKER_HOST points at the fake daemon; the cached decision is recomputed around the test."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImagelessDaemon)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("DOCKER_HOST", f"tcp://127.0.0.1:{server.server_address[1]}")
    monkeypatch.delenv("DOCKER_TLS_VERIFY", raising=False)
    sandboxes.docker_problem.cache_clear()
    yield
    server.shutdown()
    server.server_close()
    sandboxes.docker_problem.cache_clear()


def test_a_daemon_without_the_image_skips_naming_the_build_command(imageless_daemon, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"^the sandbox image retrograd-sandbox:bookworm is not on the Docker daemon \(build it: bin/build-sandbox-image\)$"):
        sandboxes.require("container")


def test_a_daemon_without_the_image_fails_under_ci(imageless_daemon, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"^CI=true but the sandbox image .* \(build it: bin/build-sandbox-image\): "):
        sandboxes.require("container")
