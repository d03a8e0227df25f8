"""Health that tells the truth (serve/launch.py, serve/model.py): ports already taken are refused naming the holder,
tritonserver never outlives its launcher, a dead Python-backend stub fails readiness and every request in flight at
once (Triton 2.51 kept answering ready and clients hung until their deadlines), and a model whose engine stopped
serving ends its stub so that the launcher sees it. Real tritonserver from nvidia-pytriton on loopback."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="tritonclient[all] not installed")
pytest.importorskip("aiohttp", reason="aiohttp not installed (the serve extra)")
if importlib.util.find_spec("pytriton") is None:
    pytest.skip("nvidia-pytriton not installed (pip install nvidia-pytriton)", allow_module_level=True)

from k3client import WAIT_S, grpc_stream, http_post, req, wait_metric  # noqa: E402

from k3deploy.serve import launch  # noqa: E402
from k3deploy.serve import repository as repo_mod  # noqa: E402
from k3deploy.serve.launch import TritonLaunchError, TritonServer, free_ports  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]

ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "output_ids" data_type: TYPE_INT32 dims: [ -1, -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
ECHO_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            ids = pb_utils.get_input_tensor_by_name(r, "input_ids").as_numpy().reshape(1, -1)
            r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("output_ids", ids)]),
                                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


@pytest.fixture(scope="module")
def echo_repo(tmp_path_factory) -> pathlib.Path:
    repo = tmp_path_factory.mktemp("health_echo")
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(textwrap.dedent(ECHO_CONFIG))
    (repo / "echo" / "1" / "model.py").write_text(textwrap.dedent(ECHO_MODEL))
    return repo


def children(pid: int) -> list[int]:
    """Live (not zombie) child processes of pid (Linux /proc)."""
    out = []
    for d in pathlib.Path("/proc").iterdir():
        try:
            if d.name.isdigit():
                stat = (d / "stat").read_text()
                state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
                if int(ppid) == pid and state != "Z":
                    out.append(int(d.name))
        except (OSError, ValueError):
            pass
    return out


def alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    except OSError:
        return False


def wait_until(pred, wait_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + wait_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.1)
    return pred()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Launcher:
    """`python -m k3deploy.serve.launch` as a user runs it; stdout lines collected on a thread."""

    def __init__(self, repo, h: int, g: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "k3deploy.serve.launch", "--repo", str(repo), "--http-port",
                                      str(h), "--grpc-port", str(g), "--timeout", str(WAIT_S), "--exit-timeout", "5"],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x.strip()) for x in self.proc.stdout], daemon=True).start()

    def wait_ready(self) -> bool:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self.lines.get(timeout=0.5) == "ready":
                    return True
            except queue.Empty:
                pass
        return False

    def tritonserver(self) -> int:
        [pid] = [c for c in children(self.proc.pid) if b"tritonserver" in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()]
        return pid

    def finish(self, wait_s: float = WAIT_S) -> tuple[int, str]:
        rc = self.proc.wait(timeout=wait_s)
        return rc, self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=WAIT_S)


# ---- ports ---------------------------------------------------------------------------------------------------

def test_taken_port_is_refused_naming_the_holder(echo_repo):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        h = holder.getsockname()[1]
        g = free_ports(1)[0]
        with pytest.raises(TritonLaunchError, match=rf"--http-port {h}: 127.0.0.1:{h} is already in use by pid "
                                                    rf"{os.getpid()} \("):
            TritonServer(echo_repo, h, g).start()
        r = subprocess.run([sys.executable, "-m", "k3deploy.serve.launch", "--repo", str(echo_repo), "--http-port",
                            str(g), "--grpc-port", str(h)], cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
        assert r.returncode == 2 and f"--grpc-port {h}: 127.0.0.1:{h} is already in use by pid {os.getpid()}" in r.stderr
        assert "ready" not in r.stdout


# ---- the launcher supervises and never leaves tritonserver behind -----------------------------------------------

def test_launcher_supervises_and_never_leaves_tritonserver_behind(echo_repo):
    """A second launcher on the same ports is refused (it printed "ready" off the first server's answer, then
    exited 1 with "Socket already in use" in its log); killing a model's stub makes the launcher exit 1 naming
    it; SIGKILL of the launcher takes tritonserver down (it kept the ports)."""
    h, g = free_ports(2)
    a = Launcher(echo_repo, h, g)
    try:
        assert a.wait_ready(), a.proc.poll()
        server = a.tritonserver()
        b = Launcher(echo_repo, h, g)
        rc, err = b.finish()
        assert rc == 2 and f"127.0.0.1:{h} is already in use by pid {a.proc.pid}" in err, err
        assert f"127.0.0.1:{g} is already in use by pid {server} (" in err and "tritonserver" in err
        [stub] = children(server)
        os.kill(stub, signal.SIGKILL)
        rc, err = a.finish()
        assert rc == 1, err
        assert "the Python backend stub of model 'echo'" in err and "exiting with status 1" in err
        assert wait_until(lambda: not alive(server)) and port_free(h) and port_free(g)
    finally:
        a.kill()
    c = Launcher(echo_repo, h, g)                               # the ports are free for the next launcher
    try:
        assert c.wait_ready(), c.proc.poll()
        assert grpc_stream(f"127.0.0.1:{g}", {"input_ids": np.array([7, 8], np.int32)}, model="echo")["tokens"] == [7, 8]
        server = c.tritonserver()
        stubs = children(server)
        c.proc.send_signal(signal.SIGKILL)                     # no handler runs: the parent-death signal acts
        c.proc.wait(timeout=WAIT_S)
        assert wait_until(lambda: not alive(server)), "tritonserver outlived its SIGKILLed launcher"
        assert wait_until(lambda: not any(alive(s) for s in stubs)), "its stubs outlived it"
        assert wait_until(lambda: port_free(g)) and port_free(h)
    finally:
        c.kill()


# ---- a stub dies while clients stream ----------------------------------------------------------------------

def test_stub_kill_fails_readiness_and_in_flight_requests_at_once(tiny_ckpt, tmp_path):
    """kill -9 of the k3 stub while streaming: clients hung until their own deadlines, the server kept answering
    ready, every later request failed "Stub process 'k3_0_0' is not healthy", the launcher noticed nothing."""
    repo_mod.write_repository(tiny_ckpt, tmp_path / "repo", "torch", max_batch=4)
    h, g, m = free_ports(3)
    srv = TritonServer(tmp_path / "repo", h, g, m, exit_timeout=5, startup_timeout=600)
    srv.start()
    try:
        out: dict = {}
        long = req([1, 2, 3], 4000, streaming=np.array([True]), end_id=np.array([-1], np.int32))
        t1 = threading.Thread(target=lambda: out.__setitem__("grpc", grpc_stream(srv.grpc_url, long, wait_s=60)))
        body = json.dumps({"input_ids": [4, 5], "request_output_len": 4000, "end_id": -1}).encode()
        t2 = threading.Thread(target=lambda: out.__setitem__("http", http_post(srv.http_url, "/v2/models/k3/generate",
                                                                               body, timeout=60)))
        t1.start()
        t2.start()
        assert wait_metric(srv.metrics_url, "k3_kda_slots_in_use", lambda v: v >= 2) >= 2
        [stub] = [p for p in launch._stubs(srv.pid, srv._shm_prefix) if p != srv.pid and launch._stub_model(p) == "k3"]
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        t1.join(WAIT_S)
        t2.join(WAIT_S)
        took = time.monotonic() - killed
        assert took < 20, f"the clients got their errors {took:.1f} s after the kill (their deadlines are 60 s)"
        assert out["grpc"]["error"] and "no final response" not in out["grpc"]["error"], out["grpc"]
        status, text = out["http"]
        assert status == 503 and "stub of model 'k3'" in json.loads(text)["error"], (status, text)
        assert srv.failure and f"(pid {stub}) died" in srv.failure
        assert not srv.is_ready() and not srv.is_alive()
        status, text = http_post(srv.http_url, "/v2/models/k3/generate", body)
        assert status == 503 and "died" in text
        server = srv.pid
    finally:
        srv.stop()
    assert not alive(server) and not alive(stub)
    assert not list(pathlib.Path("/dev/shm").glob(srv._shm_prefix + "*"))


# ---- the model ends its stub when its engine stops serving -------------------------------------------------------

def _model_module(monkeypatch):
    """serve/model.py imported with a stand-in for triton_python_backend_utils (which exists only inside a stub)."""
    pb = types.ModuleType("triton_python_backend_utils")

    class TritonError:
        INVALID_ARG, INTERNAL = 1, 2

        def __init__(self, msg, code=None):
            self.msg, self.code = msg, code

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.output_tensors, self.error = list(output_tensors), error
    pb.TritonError, pb.InferenceResponse = TritonError, InferenceResponse
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.Logger = types.SimpleNamespace(log_error=lambda m: None, log_info=lambda m: None, log_warn=lambda m: None,
                                      log_verbose=lambda m: None)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    spec = importlib.util.spec_from_file_location("k3_triton_model_under_test", ROOT / "serve" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_engine_that_stopped_serving_ends_the_stub(monkeypatch):
    mod = _model_module(monkeypatch)
    sent, exits = [], []

    class Sender:
        def send(self, response=None, flags=0):
            sent.append((response, flags))

        def is_cancelled(self):
            return False

    class Exit(BaseException):
        pass

    def fake_exit(code):
        exits.append(code)
        raise Exit
    monkeypatch.setattr(mod.os, "_exit", fake_exit)
    m = mod.TritonPythonModel()
    m.engine = types.SimpleNamespace(health=lambda: None)
    m._stop, m._wake, m._streams_lock = threading.Event(), threading.Event(), threading.Lock()
    st = mod._Stream("r#0", Sender(), {"streaming": True, "prompt": [1, 2], "exclude_input": True,
                                      "return_log_probs": False, "top_logprobs": 0, "prompt_log_probs": False})
    m._streams = {"r#0": st}
    m._check_engine()                                          # healthy: nothing happens
    assert not sent and not exits
    m.engine = types.SimpleNamespace(health=lambda: "scheduler thread died: RuntimeError: device lost")
    with pytest.raises(Exit):
        m._check_engine()
    assert exits == [3] and st.done and not m._streams
    (resp, flags), = sent
    assert flags == 1 and "device lost" in resp.error.msg
