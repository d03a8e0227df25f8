"""Clients for the robustness tests of a served k3 model (tests/serve): gRPC streams with client cancels, raw HTTP
posts (any body size), HTTP clients in a child process that the test can SIGKILL, metrics polling."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np

WAIT_S = 120  # hang guard for one wait (not a timing assertion)


def inputs(fields: dict) -> list:
    import tritonclient.grpc as grpcclient
    names = {np.int32: "INT32", np.float32: "FP32", np.bool_: "BOOL", np.uint64: "UINT64", np.int64: "INT64"}
    out = []
    for name, arr in fields.items():
        inp = grpcclient.InferInput(name, list(arr.shape), names[arr.dtype.type])
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def req(prompt, n: int, **extra) -> dict:
    """gRPC fields of a k3 request as TensorRT-LLM clients shape them (numpy arrays with the batch dimension:
    input_ids [1, L], scalars [1, 1]); extra fields given as numpy arrays of one value or [1] too."""
    d = {"input_ids": np.asarray(prompt, np.int32).reshape(1, -1), "request_output_len": np.array([[n]], np.int32)}
    d.update({k: np.asarray(v).reshape(1, -1) if np.asarray(v).ndim < 2 else v for k, v in extra.items()})
    return d


def grpc_stream(url: str, fields: dict, cancel_after: int | None = None, model: str = "k3",
                wait_s: float = WAIT_S) -> dict:
    """One request on a gRPC stream: {"tokens", "error", "final", "seconds"}; with cancel_after the client closes
    the stream (cancel_requests=True) once that many tokens came."""
    import tritonclient.grpc as grpcclient
    res = {"tokens": [], "error": None, "final": False}
    q: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    t0 = time.monotonic()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        c.async_stream_infer(model, inputs(fields), request_id="t", enable_empty_final_response=True)
        while True:
            try:
                r, e = q.get(timeout=max(0.1, t0 + wait_s - time.monotonic()))
            except queue.Empty:
                res["error"] = f"no final response within {wait_s} s"
                break
            if e is not None:
                res["error"] = str(e)
                break
            if r.get_response().outputs:
                res["tokens"] += [int(x) for x in r.as_numpy("output_ids").reshape(-1)]
            if r.get_response().parameters["triton_final_response"].bool_param:
                res["final"] = True
                break
            if cancel_after is not None and len(res["tokens"]) >= cancel_after:
                c.stop_stream(cancel_requests=True)
                break
    finally:
        c.stop_stream()
        c.close()
    res["seconds"] = time.monotonic() - t0
    return res


def http_post(hostport: str, path: str, body: bytes, headers: dict | None = None,
              timeout: float = WAIT_S) -> tuple[int, str]:
    """POST raw bytes; (status, response text). A server that resets the connection counts as status 0."""
    host, port = hostport.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, r.read().decode(errors="replace")
    except (ConnectionError, http.client.HTTPException) as e:
        return 0, repr(e)
    finally:
        c.close()


def generate(hostport: str, body: dict, stream: bool = False) -> tuple[int, list]:
    """HTTP generate (one JSON) or generate_stream (SSE events); (status, list of event/response objects)."""
    status, text = http_post(hostport, f"/v2/models/k3/generate{'_stream' if stream else ''}", json.dumps(body).encode())
    if not stream:
        return status, [json.loads(text)] if text else []
    return status, [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def tokens_of(events: list) -> list[int]:
    out = []
    for e in events:
        v = e.get("output_ids", [])
        out += v if isinstance(v, list) else [v]
    return out


CHILD = r"""
import http.client, json, sys
host, port, path, body = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
c = http.client.HTTPConnection(host, port)
c.request("POST", path, body=body.encode(), headers={"Content-Type": "application/json"})
print("sent", flush=True)
r = c.getresponse()
while r.read(1):
    pass
"""


def http_child(hostport: str, path: str, body: dict) -> subprocess.Popen:
    """An HTTP client in a child process (the test SIGKILLs it mid-request: a client that dies)."""
    host, port = hostport.rsplit(":", 1)
    p = subprocess.Popen([sys.executable, "-c", CHILD, host, port, path, json.dumps(body)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    assert p.stdout.readline().strip() == "sent"
    return p


def metric(metrics_url: str, name: str) -> float | None:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.M)
    return None if m is None else float(m.group(1))


def wait_metric(metrics_url: str, name: str, pred, wait_s: float = WAIT_S) -> float | None:
    """Poll until pred(value); returns the last value (the caller asserts on it)."""
    deadline = time.monotonic() + wait_s
    v = metric(metrics_url, name)
    while not (v is not None and pred(v)) and time.monotonic() < deadline:
        time.sleep(0.1)
        v = metric(metrics_url, name)
    return v


@contextlib.contextmanager
def launcher(repo, *args: str, root, timeout_s: float = 600):
    """`python -m k3deploy.serve.launch --repo REPO ARGS...` as a user runs it: yields (process, {"http": URL,
    "grpc": HOST:PORT, "openai": URL, ...}) once it prints "ready"; SIGTERM (then kill) on exit. Its log goes to
    REPO/../launch.log; an exit before "ready" is an AssertionError with the log's end."""
    log_path = pathlib.Path(repo).parent / "launch.log"
    cmd = [sys.executable, "-m", "k3deploy.serve.launch", "--repo", str(repo), "--timeout", str(int(timeout_s)),
           "--log-level", "WARNING", *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=log, text=True,
                                env=dict(os.environ, PYTHONPATH=str(root)))
        try:
            urls = {}
            deadline = time.monotonic() + timeout_s
            for line in proc.stdout:                 # "http URL", "grpc HOST:PORT", ..., then "ready"
                if line.strip() == "ready":
                    break
                key, _, value = line.strip().partition(" ")
                urls[key] = value.strip()
                assert time.monotonic() < deadline, "the launcher did not get ready"
            else:
                raise AssertionError(f"launcher exited with {proc.wait()}: {log_path.read_text()[-3000:]}")
            yield proc, urls
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
