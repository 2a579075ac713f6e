#!/usr/bin/env python3
"""An OpenAI-style completions server that misbehaves on purpose, one way per MODE, to see
what a load generator makes of it (`engine bench`: see docs/results/reliability-cpu.md):

    python3 scripts/misbehaving_server.py PORT MODE &
    ./target/release/engine bench --server http://127.0.0.1:PORT \
        --scenario scenarios/baseline.toml --set workload.num_requests=4 \
        --set workload.warmup_requests=0 --set workload.output_tokens=4 --no-progress

MODE: ok, crlf, no_done, done_only, usage_only, nonstream, single_nl, no_trailing_blank,
trunc_last, multiline, empty_first, error_mid, event_error, bad_json, reset, eof_mid,
comments, split, multi_choice, endless, huge (HUGE_MB, default 50), hang_mid, multitok,
slow_first / slow_headers (SLOW seconds, default 10), 429, 503, 500html, redirect302,
redirect307, models_empty, models_odd. `fail_after_test_MODE` answers the load generator's
test request (prompt "Hello", 2 tokens) properly and the rest with MODE. NTOK (default 4)
caps the tokens a stream sends; LOG names a file that gets one line per request.
"""
import json, os, sys, time, socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
MODE = sys.argv[2] if len(sys.argv) > 2 else "ok"
PORT = int(sys.argv[1])
NTOK = int(os.environ.get("NTOK", "4"))
LOG = open(os.environ.get("LOG", os.devnull), "a")

def chunk(text, usage=None, choices=True):
    d = {"id": "x", "object": "text_completion", "model": "m",
         "choices": [{"index": 0, "text": text, "finish_reason": None}] if choices else []}
    if usage is not None: d["usage"] = usage
    return d

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def send_json(self, code, obj, extra=None):
        b = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        for k, v in (extra or {}).items(): self.send_header(k, v)
        self.end_headers(); self.wfile.write(b)
    def do_GET(self):
        LOG.write(f"GET {self.path}\n"); LOG.flush()
        if self.path == "/v1/models":
            if MODE == "models_empty": return self.send_json(200, {"object": "list", "data": []})
            if MODE == "models_odd": return self.send_json(200, [{"id": "m"}])
            return self.send_json(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
        if self.path == "/v1/completions":  # redirect target hit by GET
            return self.send_json(405, {"error": "GET not allowed"})
        self.send_json(404, {"detail": "Not Found"})
    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0)); body = self.rfile.read(n)
        LOG.write(f"POST {self.path} {body[:80]!r}\n"); LOG.flush()
        if self.path == "/v1/completions" and MODE.startswith("redirect") :
            code = 302 if MODE == "redirect302" else 307
            self.send_response(code); self.send_header("Location", "/v2/completions")
            self.send_header("Content-Length", "0"); self.end_headers(); return
        if self.path not in ("/v1/completions", "/v2/completions"):
            return self.send_json(404, {"detail": "Not Found"})
        req = json.loads(body)
        is_test = req.get("max_tokens") == 2 and req.get("prompt") == "Hello"
        m = MODE
        if m.startswith("fail_after_test_") and not is_test:
            m = m[len("fail_after_test_"):]
        elif m.startswith("fail_after_test_"):
            m = "ok"
        if m == "429": return self.send_json(429, {"error": {"message": "rate limited"}}, {"Retry-After": "1"})
        if m == "503": return self.send_json(503, {"error": {"message": "overloaded"}})
        if m == "500html":
            b = b"<html><body><h1>500 Internal Server Error</h1>" + b"x"*5000 + b"</body></html>"
            self.send_response(500); self.send_header("Content-Type", "text/html"); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b); return
        if m == "nonstream":
            return self.send_json(200, {"id": "x", "choices": [{"index": 0, "text": "hello world", "finish_reason": "length"}], "usage": {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}})
        if m == "slow_headers":
            time.sleep(float(os.environ.get("SLOW", "10")))
        # streaming
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        w = self.wfile
        nl = "\r\n" if m == "crlf" else "\n"
        def ev(obj, sep=nl*2):
            s = obj if isinstance(obj, str) else json.dumps(obj)
            w.write(f"data: {s}{sep}".encode()); w.flush()
        ntok = req.get("max_tokens", NTOK) if m != "ok_small" else NTOK
        ntok = min(ntok, NTOK)
        if m == "slow_first":
            time.sleep(float(os.environ.get("SLOW", "10")))
        if m == "done_only":
            ev("[DONE]"); return
        if m == "usage_only":
            ev(chunk("", {"prompt_tokens": 5, "completion_tokens": ntok, "total_tokens": 5+ntok}, choices=False)); ev("[DONE]"); return
        if m == "single_nl":
            for i in range(ntok): ev(chunk(f" t{i}"), sep="\n"); time.sleep(0.01)
            ev("[DONE]", sep="\n"); return
        if m == "no_trailing_blank":
            for i in range(ntok): ev(chunk(f" t{i}")); time.sleep(0.01)
            ev(chunk("", {"prompt_tokens": 5, "completion_tokens": ntok, "total_tokens": 5+ntok}, choices=False), sep="\n")
            return
        if m == "trunc_last":
            for i in range(ntok): ev(chunk(f" t{i}")); time.sleep(0.01)
            w.write(b"data: " + json.dumps(chunk(" last", {"prompt_tokens": 5, "completion_tokens": 3*ntok+1, "total_tokens": 6+3*ntok})).encode()); w.flush(); return
        if m == "multiline":
            for i in range(ntok):
                j = json.dumps(chunk(f" t{i}"), indent=1)
                w.write(("".join("data: "+l+"\n" for l in j.split("\n")) + "\n").encode()); w.flush(); time.sleep(0.01)
            ev("[DONE]"); return
        if m == "empty_first":
            ev(chunk("")); time.sleep(0.5)
            for i in range(ntok): ev(chunk(f" t{i}")); time.sleep(0.01)
            ev(chunk("", {"prompt_tokens": 5, "completion_tokens": ntok, "total_tokens": 5+ntok}, choices=False)); ev("[DONE]"); return
        if m == "error_mid":
            ev(chunk(" a")); ev({"error": {"message": "boom", "code": 500}}); return
        if m == "event_error":
            ev(chunk(" a")); w.write(b"event: error\ndata: {\"message\": \"boom\"}\n\n"); w.flush(); return
        if m == "bad_json":
            ev(chunk(" a")); ev("{not json"); return
        if m == "reset":
            ev(chunk(" a")); time.sleep(0.05)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.connection.close(); return
        if m == "eof_mid":
            ev(chunk(" a")); return  # close, no DONE, no usage
        if m == "comments":
            w.write(b": keep-alive\n\n"); w.write(b"event: message\nid: 1\nretry: 100\n"); w.flush()
            w.write(b"data: " + json.dumps(chunk(" a")).encode() + b"\n\n"); w.flush()
        if m == "split":
            for i in range(ntok):
                s = b"data: " + json.dumps(chunk(f" t{i}")).encode() + b"\n\n"
                for j in range(0, len(s), 7): w.write(s[j:j+7]); w.flush(); time.sleep(0.001)
            ev("[DONE]"); return
        if m == "multi_choice":
            for i in range(ntok):
                d = chunk(f" t{i}"); d["choices"].append({"index": 1, "text": f" u{i}", "finish_reason": None}); ev(d); time.sleep(0.01)
            ev("[DONE]"); return
        if m == "endless":
            i = 0
            try:
                while True: ev(chunk(" x")); i += 1; time.sleep(0.001)
            except Exception: return
        if m == "huge":
            big = " " + "y"*int(float(os.environ.get("HUGE_MB","50"))*1024*1024)
            try: ev(chunk(big))
            except Exception: return
            ev("[DONE]"); return
        if m == "hang_mid":
            ev(chunk(" a")); time.sleep(3600); return
        if m == "multitok":  # 4 tokens per chunk, usage at end
            for i in range(ntok): ev(chunk(f" t{i}")); time.sleep(0.02)
            ev(chunk("", {"prompt_tokens": 5, "completion_tokens": ntok*4, "total_tokens": 5+ntok*4}, choices=False)); ev("[DONE]"); return
        # default ok / crlf / no_done
        for i in range(ntok): ev(chunk(f" t{i}")); time.sleep(0.01)
        ev(chunk("", {"prompt_tokens": 5, "completion_tokens": ntok, "total_tokens": 5+ntok}, choices=False))
        if m != "no_done": ev("[DONE]")

ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", PORT), H).serve_forever()
