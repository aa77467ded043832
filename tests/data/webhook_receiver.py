"""A webhook receiver for the tests: verifies every request with the Standard
Webhooks reference library (`standardwebhooks` on PyPI) and records it.

Usage: webhook_receiver.py SECRET PORT_FILE LOG_FILE CONTROL_DIR

* Each request is verified (signature, timestamp tolerance); a request that
  fails verification is answered 401 and recorded with "valid": false.
* CONTROL_DIR/status, when present, holds a status to answer every request
  with (an outage: 503).
* An event whose envelope contains "poison" is answered 422 (a permanent
  rejection).
* Otherwise 204. Each request is one JSON line in LOG_FILE:
  {"id": webhook-id, "valid": bool, "status": answered, "body": text}.
"""
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook

secret, port_file, log_file, control = sys.argv[1:5]
hook = Webhook(secret)
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            hook.verify(body, headers)
            valid = True
        except Exception:
            valid = False
        status = 204
        try:
            with open(os.path.join(control, "status")) as f:
                status = int(f.read().strip())
        except (FileNotFoundError, ValueError):
            pass
        if not valid:
            status = 401
        elif status == 204 and b"poison" in body:
            status = 422
        with lock, open(log_file, "a") as f:
            f.write(json.dumps({"id": headers.get("webhook-id"), "valid": valid,
                                "status": status, "body": body.decode()}) + "\n")
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
with open(port_file + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
os.rename(port_file + ".tmp", port_file)
server.serve_forever()
