"""A WSGI app for gunicorn's pre-fork workers (tests/record/test_servers.py): GET /leak keeps
64 KiB in the worker that serves it (handle_leak); every answer is "PID BYTES", what that worker
holds in all."""

import os

held: list[bytearray] = []


def handle_leak() -> None:
    held.append(bytearray(64 << 10))


def app(environ, start_response):
    if environ.get("PATH_INFO") == "/leak":
        handle_leak()
    body = f"{os.getpid()} {sum(len(b) for b in held)}".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
