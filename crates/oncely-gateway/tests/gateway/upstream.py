"""A deliberately non-idempotent order service: every POST /orders inserts a row.

Usage: python3 upstream.py DB_FILE PORT   (PORT 0: any free port; the port is printed)

  POST /orders          inserts {"id", ...body} and answers it, 201 (422 for a negative
                        amount_minor, after inserting nothing)
  GET  /orders?external_ref=R   the orders with that external_ref, a JSON array
  GET  /orders/count    {"count": n}
  POST /_faults         queues a fault for the next POST /orders:
                        "fail_503" (answers 503, inserts nothing), "slow:SECS" (sleeps,
                        then inserts and answers), "drop" (inserts, then closes the
                        connection without an answer), "vanish" (closes the
                        connection without inserting or answering)
  anything else         200 {"path", "method"} with Set-Cookie and X-Upstream headers
"""
import json
import socket
import sqlite3
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

DB = sys.argv[1]
LOCK = threading.Lock()
FAULTS = []


def query(sql, args=()):
    with LOCK:
        conn = sqlite3.connect(DB)
        try:
            rows = conn.execute(sql, args).fetchall()
            conn.commit()
            return rows
        finally:
            conn.close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status, obj, extra=()):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Set-Cookie", "session=upstream-secret")
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        try:
            self.wfile.write(body)
        except BrokenPipeError:
            pass  # the gateway gave up on a slow answer (a timeout test)

    def do_POST(self):
        path = urlparse(self.path).path
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if path == "/_faults":
            FAULTS.append(body.decode())
            return self.answer(200, {"queued": len(FAULTS)})
        if path != "/orders":
            return self.other(body.decode())
        fault = FAULTS.pop(0) if FAULTS else ""
        if fault == "vanish":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault == "fail_503":
            return self.answer(503, {"error": "overloaded"})
        if fault.startswith("slow:"):
            time.sleep(float(fault[5:]))
        try:
            order = json.loads(body or b"{}")
        except ValueError:
            return self.answer(400, {"error": "not json"})
        if order.get("amount_minor", 0) < 0:
            return self.answer(422, {"error": "negative amount"})
        out = {"id": str(uuid.uuid4()), **order,
               "idempotency_key": self.headers.get("Idempotency-Key"),
               "tenant": self.headers.get("Oncely-Tenant")}
        query("INSERT INTO orders (id, external_ref, answer) VALUES (?, ?, ?)",
              (out["id"], str(order.get("external_ref")), json.dumps(out)))
        if fault == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        return self.answer(201, out, [("Location", "/orders/" + out["id"])])

    def do_GET(self):
        url = urlparse(self.path)
        if url.path == "/orders/count":
            (n,), = query("SELECT COUNT(*) FROM orders")
            return self.answer(200, {"count": n})
        if url.path == "/orders":
            ref = parse_qs(url.query).get("external_ref", [""])[0]
            rows = query("SELECT answer FROM orders WHERE external_ref = ?", (ref,))
            return self.answer(200, [json.loads(a) for (a,) in rows])
        return self.other("")

    def do_PUT(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.other(self.rfile.read(n).decode())

    def other(self, sent):
        self.answer(200, {"path": self.path, "method": self.command, "body": sent,
                          "tenant": self.headers.get("Oncely-Tenant")},
                    [("X-Upstream", "yes")])


query("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, external_ref TEXT, answer TEXT)")
server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Handler)
server.daemon_threads = True
print(server.server_address[1], flush=True)
server.serve_forever()
