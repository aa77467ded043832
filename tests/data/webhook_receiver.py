"""A webhook receiver for the tests: verifies every request with the Standard
Webhooks reference library (`standardwebhooks` on PyPI), deduplicates by
`webhook-id` as the specification tells receivers to, and records it.

Usage: webhook_receiver.py SECRET PORT_FILE LOG_FILE CONTROL_DIR

* Each request is verified (signature, timestamp tolerance); a request that
  fails verification is answered 401 and recorded with "valid": false.
* Deduplication: a valid request whose `webhook-id` was processed before is
  answered 204 without being processed again ("processed": false), as a
  receiver following the specification does.
* CONTROL_DIR/status, when present, holds a status to answer every request
  with (an outage: 503); nothing is processed.
* CONTROL_DIR/script.json, when present, is a list of faults applied one to
  each of the next requests (the file is rewritten without the one taken):
  {"kind": "lose"}: processed, then the connection is reset without an answer;
  {"kind": "late", "delay": S}: processed, answered S seconds later;
  {"kind": "slow", "delay": S}: held S seconds, then processed and answered;
  {"kind": "status", "status": N}: answered N, not processed.
* CONTROL_DIR/refuse.json, when present, is a list of {"marker": M,
  "status": N}: a request whose body holds M is answered N, not processed.
* CONTROL_DIR/quota.json, when present, is {"per_second": R, "burst": B}: a
  request beyond that many requests a second is answered 429, not processed.
* An event whose envelope contains "poison" is answered 422 (a permanent
  rejection); one that contains "nulbyte" too, with a body that holds a NUL
  byte (a receiver's text the relay must still be able to record).
* Otherwise 204. Each request is one JSON line in LOG_FILE:
  {"id": webhook-id, "valid": bool, "status": answered, "processed": bool,
   "fault": what was done or null, "body": text}; processed requests are
  logged when processed, in the order processed.
"""
import json
import os
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook

secret, port_file, log_file, control = sys.argv[1:5]
hook = Webhook(secret)
lock = threading.Lock()
seen = set()
bucket = {"tokens": None, "at": 0.0}


def read_json(name):
    try:
        with open(os.path.join(control, name)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def next_fault():
    """The next scripted fault (under `lock`), or None."""
    script = read_json("script.json")
    if not script:
        return None
    path = os.path.join(control, "script.json")
    with open(path + ".tmp", "w") as f:
        json.dump(script[1:], f)
    os.rename(path + ".tmp", path)
    return script[0]


def within_quota():
    """Whether one more request is within the quota (under `lock`)."""
    quota = read_json("quota.json")
    if not quota:
        bucket["tokens"] = None
        return True
    now = time.monotonic()
    if bucket["tokens"] is None:
        bucket["tokens"] = float(quota["burst"])
    else:
        bucket["tokens"] = min(float(quota["burst"]),
                               bucket["tokens"] + (now - bucket["at"]) * quota["per_second"])
    bucket["at"] = now
    if bucket["tokens"] >= 1.0:
        bucket["tokens"] -= 1.0
        return True
    return False


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log(self, headers, valid, status, processed, fault, body):
        with open(log_file, "a") as f:
            f.write(json.dumps({"id": headers.get("webhook-id"), "valid": valid,
                                "status": status, "processed": processed,
                                "fault": fault, "body": body.decode()}) + "\n")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            hook.verify(body, headers)
            valid = True
        except Exception:
            valid = False
        status = 204
        fixed = None
        try:
            with open(os.path.join(control, "status")) as f:
                fixed = int(f.read().strip())
        except (FileNotFoundError, ValueError):
            pass
        fault = None
        with lock:
            if not valid:
                status = 401
            elif fixed is not None:
                status = fixed
            else:
                for refusal in read_json("refuse.json") or []:
                    if refusal["marker"].encode() in body:
                        status = refusal["status"]
                        fault = {"kind": "refuse", "status": status}
                        break
                if fault is None and (b"poison" in body or b"nulbyte" in body):
                    status = 422
                if status == 204:
                    fault = next_fault()
                    if fault is None and not within_quota():
                        status = 429
                        fault = {"kind": "quota"}
                    elif fault is not None and fault["kind"] == "status":
                        status = fault["status"]
        kind = fault["kind"] if fault else None
        if kind == "slow":
            time.sleep(fault["delay"])
        processed = False
        with lock:
            if status == 204 and valid:
                wid = headers.get("webhook-id")
                processed = wid not in seen
                seen.add(wid)
            self.log(headers, valid, status, processed, fault, body)
        if kind == "lose":
            # Reset: SO_LINGER 0, then close.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if kind == "late":
            time.sleep(fault["delay"])
        answer = b"refused\x00by the receiver" if b"nulbyte" in body else b""
        try:
            self.send_response(status)
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        except OSError:
            self.close_connection = True

    def log_message(self, *args):
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that went away (a late answer, a reset)


server = Server(("127.0.0.1", 0), Handler)
with open(port_file + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
os.rename(port_file + ".tmp", port_file)
server.serve_forever()
