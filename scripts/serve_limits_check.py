#!/usr/bin/env python3
"""Two of `engine serve`'s limits, measured from outside, each on a server it starts:

    python3 scripts/serve_limits_check.py tokenize    [ENGINE] [PORT]
    python3 scripts/serve_limits_check.py connections [ENGINE] [PORT]

`tokenize`: four concurrent 4 MiB `POST /tokenize` on `builtin:tiny`; prints the server's
resident memory before, at its peak and after (Linux: /proc). `connections`: four
connections part-way through a body fill `--max-connections 4`, then ten clients of
Python's `http.client` (head, then body) post a completion; prints what each got (503, or
the exception when the answer was lost to a reset). ENGINE defaults to
target/release/engine, PORT to 18190.
"""
import http.client
import json
import socket
import subprocess
import sys
import threading
import time


def start(engine, port, *flags):
    p = subprocess.Popen([engine, "serve", "--model", "builtin:tiny", "--port", str(port), *flags],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p
        except OSError:
            pass
        time.sleep(0.5)
    p.kill()
    sys.exit("the server did not become healthy")


def mib(pid, key):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key):
            return int(line.split()[1]) // 1024
    return -1


def tokenize(engine, port):
    p = start(engine, port)
    before = mib(p.pid, "VmRSS")
    body = json.dumps({"prompt": "a b" * 1300000})  # 3.9 MB, 2.6 M tokens

    def one():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/tokenize", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        assert r.status == 200, r.status

    jobs = [threading.Thread(target=one) for _ in range(4)]
    t0 = time.time()
    [j.start() for j in jobs]
    [j.join() for j in jobs]
    print(f"4 concurrent 4 MiB /tokenize in {time.time() - t0:.1f} s: resident {before} MiB "
          f"before, {mib(p.pid, 'VmHWM')} MiB at the peak, {mib(p.pid, 'VmRSS')} MiB after")
    p.terminate()
    p.wait()


def connections(engine, port):
    p = start(engine, port, "--max-connections", "4")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{")
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    for s in held:
        s.sendall(head)
    time.sleep(0.5)

    def ask():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            c.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 2}),
                      headers={"Content-Type": "application/json"})
            return c.getresponse().status
        except OSError as e:
            return type(e).__name__

    got = [ask() for _ in range(10)]
    print(f"the 5th client at --max-connections 4, 10 times: {got}")
    for s in held:
        s.close()
    p.terminate()
    p.wait()


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    engine = sys.argv[2] if len(sys.argv) > 2 else "target/release/engine"
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 18190
    checks = {"tokenize": tokenize, "connections": connections}
    if what not in checks:
        sys.exit(__doc__)
    checks[what](engine, port)
