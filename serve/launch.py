"""Start the ``tritonserver`` binary bundled in ``nvidia-pytriton`` against a model repository.

The wheel ships the server binary (``pytriton/tritonserver/bin/tritonserver``), the Python backend
(``pytriton/tritonserver/backends/python``), one Python-backend stub per Python version
(``pytriton/tritonserver/python_backend_stubs/<X.Y>/``) and the shared libraries the binary needs
(``nvidia_pytriton.libs``).  To run it outside PyTriton we

1. copy the Python backend plus the stub matching the running interpreter into a private
   ``<workdir>/backends/python`` (the stub must sit next to ``libtriton_python.so``),
2. put ``nvidia_pytriton.libs`` and this interpreter's ``libpython`` directory on ``LD_LIBRARY_PATH``
   and this interpreter's ``bin`` first on ``PATH`` (the stub resolves ``python`` there, which makes the
   embedded interpreter use this virtual environment's packages),
3. refuse ports already taken (naming the process holding each one when /proc shows it), start the binary with
   gRPC/metrics bound to ``127.0.0.1`` and its HTTP on an internal loopback port behind the HTTP front
   (:mod:`serve.front`: body cap, JSON checks, disconnects cancel) that owns ``--http-port``, and poll readiness;
4. supervise: tritonserver dies with its launcher (``PR_SET_PDEATHSIG``: SIGKILL when the launching thread exits,
   even under SIGKILL; a sweeper process then ends the stubs it started and their shared memory), and a watcher
   thread declares the server failed when tritonserver exits or one of the
   Python-backend stubs it started dies (Triton 2.51 keeps answering ready then, and every later request fails
   "Stub process ... is not healthy"): readiness turns 503 with the reason, in-flight HTTP requests get an error,
   tritonserver's process group is killed (gRPC clients get UNAVAILABLE at once) and :attr:`TritonServer.failure`
   says why; the CLI exits 1 with it (restart it from the service manager).

CLI::

    python -m k3deploy.serve.launch --repo REPO --http-port 8000 --grpc-port 8001 [--metrics-port 8002]
    k3deploy serve --repo REPO --openai-port 8080     # + the OpenAI-compatible front (serve/openai.py)

With ``--openai-port`` the front runs as a second child process (:class:`OpenAIFront`) talking to the server's
gRPC port; both stop on SIGINT/SIGTERM (front first), and either one exiting stops the other.

Python::

    with TritonServer(repo, http_port=8000, grpc_port=8001, metrics_port=8002) as srv:
        ...  # srv.http_url, srv.grpc_url, srv.metrics_url; srv.failure (None while healthy)
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import functools
import importlib.metadata
import importlib.util
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Optional, Sequence

LOGGER = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
WATCH_INTERVAL_S = 0.2
_PR_SET_PDEATHSIG = 1
try:                                   # resolved here: a preexec_fn must not import (the child holds no locks)
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):      # not Linux
    _prctl = None


class TritonLaunchError(RuntimeError):
    """The server could not be prepared, died during start-up, or did not become ready in time."""


@dataclasses.dataclass(frozen=True)
class TritonDistribution:
    """Paths of the Triton Inference Server shipped inside the installed ``nvidia-pytriton`` wheel."""

    root: pathlib.Path  # .../pytriton/tritonserver
    binary: pathlib.Path  # root/bin/tritonserver
    python_backend: pathlib.Path  # root/backends/python
    stubs: pathlib.Path  # root/python_backend_stubs
    libs: pathlib.Path  # .../nvidia_pytriton.libs (or root/external_libs for editable installs)
    caches: pathlib.Path  # root/caches

    def stub_for(self, version: Optional[str] = None) -> pathlib.Path:
        """Return the Python-backend stub for ``version`` ("X.Y", default: the running interpreter).

        Raises:
            TritonLaunchError: no stub is shipped for that Python version.
        """
        version = version or f"{sys.version_info[0]}.{sys.version_info[1]}"
        stub = self.stubs / version / "triton_python_backend_stub"
        if not stub.is_file():
            have = sorted(p.name for p in self.stubs.iterdir()) if self.stubs.is_dir() else []
            raise TritonLaunchError(
                f"nvidia-pytriton ships no Python-backend stub for Python {version} (looked for {stub}; "
                f"available: {', '.join(have) or 'none'}). Run the launcher with one of those Python versions."
            )
        return stub


def find_distribution() -> TritonDistribution:
    """Locate the ``tritonserver`` bundled in ``nvidia-pytriton`` without importing ``pytriton``.

    Raises:
        TritonLaunchError: ``nvidia-pytriton`` is not installed or its server tree is incomplete.
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonLaunchError(
            "package 'pytriton' not found: install it with `pip install nvidia-pytriton` into the "
            f"interpreter running the launcher ({sys.executable})"
        )
    pkg = pathlib.Path(list(spec.submodule_search_locations)[0])
    root = pkg / "tritonserver"
    libs = pkg.parent / "nvidia_pytriton.libs"
    if not libs.is_dir():  # editable install layout
        libs = root / "external_libs"
    dist = TritonDistribution(
        root=root,
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stubs=root / "python_backend_stubs",
        libs=libs,
        caches=root / "caches",
    )
    for what, path in (("server binary", dist.binary), ("python backend", dist.python_backend / "libtriton_python.so"),
                       ("shared libraries", dist.libs)):
        if not path.exists():
            raise TritonLaunchError(f"nvidia-pytriton install is incomplete: {what} missing at {path}; "
                                    "reinstall with `pip install --force-reinstall nvidia-pytriton`")
    return dist


def prepare_backends(dist: TritonDistribution, workdir: pathlib.Path) -> pathlib.Path:
    """Copy the Python backend and the stub for this interpreter into ``workdir/backends``; return that dir."""
    backends = workdir / "backends"
    dst = backends / "python"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(dist.python_backend, dst,
                    ignore=shutil.ignore_patterns("__pycache__", "triton_python_backend_stub"))
    stub_dst = dst / "triton_python_backend_stub"
    shutil.copy2(dist.stub_for(), stub_dst)
    stub_dst.chmod(0o755)
    return backends


STUB_SITE_ENV = "K3_TRITON_STUB_SITE"


def default_stub_site() -> pathlib.Path:
    """Directory holding ``numpy<2`` for the stub: ``$K3_TRITON_STUB_SITE`` or
    ``~/.cache/k3deploy/triton-stub-site/pyX.Y``."""
    env = os.environ.get(STUB_SITE_ENV)
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "k3deploy" / "triton-stub-site" / f"py{sys.version_info[0]}.{sys.version_info[1]}"


def _numpy_major(paths: Optional[Sequence[str]] = None) -> Optional[int]:
    """Major version of the numpy distribution visible on ``paths`` (default ``sys.path``), without importing it."""
    for d in importlib.metadata.distributions(name="numpy", **({"path": list(paths)} if paths is not None else {})):
        return int(d.version.split(".")[0])
    return None


def prepare_python_env(workdir: pathlib.Path, stub_site: Optional[pathlib.Path] = None) -> pathlib.Path:
    """Return the ``bin`` directory whose ``python`` the stub should resolve through ``PATH``.

    The stub of nvidia-pytriton 0.7.0 (Triton 2.51) is compiled against the numpy 1.x C ABI: with numpy 2
    in the environment, tensors cross the stub empty or garbled (no error is raised). When this interpreter
    has numpy >= 2 we therefore build a small overlay virtual environment in ``workdir/stubenv`` whose
    ``sys.path`` is ``stub_site`` (holding numpy<2) first, then this interpreter's site-packages (torch, the
    project's dependencies, ...). With numpy < 2 the interpreter's own ``bin`` is returned unchanged.

    Raises:
        TritonLaunchError: numpy >= 2 is installed and ``stub_site`` holds no numpy < 2.
    """
    major = _numpy_major()
    if major is None or major < 2:
        return pathlib.Path(sys.executable).parent
    site_dir = pathlib.Path(stub_site) if stub_site is not None else default_stub_site()
    site_major = _numpy_major([str(site_dir)]) if site_dir.is_dir() else None
    if site_major is None or site_major >= 2:
        raise TritonLaunchError(
            f"numpy {importlib.metadata.version('numpy')} is installed in {sys.prefix}, but nvidia-pytriton's "
            "Python-backend stub is built for the numpy 1.x ABI (tensors would arrive empty or garbled). "
            f"Give the stub its own numpy<2 (the environment keeps numpy 2): "
            f"`{sys.executable} -m pip install --target {site_dir} 'numpy<2'` "
            f"(or point ${STUB_SITE_ENV} / --stub-site at a directory holding numpy<2)."
        )
    env_dir = workdir / "stubenv"
    bin_dir = env_dir / "bin"
    pyver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    sp = env_dir / "lib" / pyver / "site-packages"
    sp.mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    base_exe = pathlib.Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    (env_dir / "pyvenv.cfg").write_text(
        f"home = {base_exe.parent}\ninclude-system-site-packages = false\n"
        f"version = {sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}\n")
    for name in ("python", "python3", pyver):
        link = bin_dir / name
        if not link.exists():
            link.symlink_to(base_exe)
    # .pth files run in name order: numpy<2 first, then the real environment (with its own .pth files).
    (sp / "00_k3_stub_numpy.pth").write_text(f"{site_dir.resolve()}\n")
    parent_sites = [p for p in sysconfig.get_paths().values() if p.endswith("site-packages")]
    lines = "".join(f"import site; site.addsitedir({str(p)!r})\n" for p in dict.fromkeys(parent_sites))
    (sp / "01_k3_parent_env.pth").write_text(lines)
    return bin_dir


def server_env(dist: TritonDistribution, python_bin: Optional[pathlib.Path] = None,
               base: Optional[dict] = None) -> dict:
    """Environment for ``tritonserver`` and its Python stubs: ``LD_LIBRARY_PATH`` gets the bundled libs and
    this interpreter's libpython directory, ``PATH`` starts with ``python_bin`` (default: this interpreter's
    ``bin``) so the stub embeds the right environment."""
    env = dict(os.environ if base is None else base)
    lib_dirs = [str(dist.libs)]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        # Make the stub load the libpython of *this* interpreter, not whichever one the system has.
        libdir = sysconfig.get_config_var("LIBDIR")
        if libdir:
            lib_dirs.insert(0, libdir)
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs)
    bin_dir = str(python_bin or pathlib.Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir] + ([env["PATH"]] if env.get("PATH") else []))
    return env


def free_ports(n: int, host: str = DEFAULT_HOST) -> list[int]:
    """Return ``n`` distinct TCP ports that were free on ``host`` a moment ago (bound to port 0, then closed)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def port_owner(port: int) -> Optional[str]:
    """"pid N (command line)" of a process listening on TCP `port` (any address), from /proc/net/tcp{,6} and the
    /proc/<pid>/fd links; None when no listener is visible (another user's process, another network namespace)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:     # 0A = LISTEN
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                    return f"pid {d.name} ({cmd[:200]})"
        except OSError:
            continue
    return None


def check_ports_free(host: str, ports: dict) -> None:
    """Raise TritonLaunchError naming each `{flag: port}` that cannot be bound on `host`, and who holds it."""
    taken = []
    for flag, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)       # as the servers bind: TIME_WAIT is free
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise TritonLaunchError(f"{flag} {port}: cannot bind {host}:{port} ({e.strerror})") from e
                owner = port_owner(port)
                taken.append(f"{flag} {port}: {host}:{port} is already in use by "
                             + (owner or "a process not visible here (another user's, or another network namespace)"))
    if taken:
        raise TritonLaunchError("; ".join(taken) + ". Stop it (an old server?) or choose other ports.")


# The sweeper: a small process that outlives a SIGKILLed launcher by a moment. The parent-death signal ends
# tritonserver, but not the Python-backend stubs it started (they would keep the model's memory and shared memory):
# once the launcher is gone (its parent pid changes) the sweeper kills every process of the server's group that
# carries the server's shared-memory prefix (the `_stubs` rule, never a bare group id) and removes that prefix's
# shared-memory files. A normal stop ends the sweeper first.
_SWEEPER = r"""
import glob, os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
launcher, pgid, prefix = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def members():
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = open("/proc/%s/stat" % d).read()
                st = st[st.rindex(")") + 2:].split()
                if int(st[2]) == pgid and st[0] != "Z" and prefix.encode() in open("/proc/%s/cmdline" % d, "rb").read():
                    out.append(int(d))
            except (OSError, ValueError):
                pass
    return out
while os.getppid() == launcher:
    time.sleep(0.2)
for _ in range(100):
    left = members()
    if not left:
        break
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.1)
for f in glob.glob("/dev/shm/" + prefix + "*"):
    try:
        os.unlink(f)
    except OSError:
        pass
"""


def _die_with_parent(parent: int) -> None:
    """preexec_fn of tritonserver: SIGKILL when the launching thread exits (also when the launcher is SIGKILLed);
    exits at once if the launcher is already gone."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class TritonServer:
    """A ``tritonserver`` child process serving ``repo`` on loopback ports.

    Args:
        repo: model repository directory.
        http_port, grpc_port: ports for the HTTP/REST and gRPC endpoints.
        metrics_port: Prometheus metrics port; ``None`` disables the metrics endpoint.
        host: address every endpoint binds to (default ``127.0.0.1``).
        workdir: where backends are copied and the server log is written; default a temporary
            directory removed by :meth:`stop`.
        startup_timeout: seconds :meth:`wait_ready` waits by default.
        exit_timeout: seconds the server may take to drain in-flight requests when stopped.
        log_verbose: ``--log-verbose`` level.
        extra_args: more ``tritonserver`` flags, appended last.
        stub_site: directory with numpy<2 for the stub when this environment has numpy 2
            (default :func:`default_stub_site`); see :func:`prepare_python_env`.

    ``http_port`` is the HTTP front (:mod:`serve.front`); tritonserver's own HTTP endpoint listens on an internal
    loopback port. Start it from a thread that outlives the server (the main thread): tritonserver is killed when
    the thread that started it exits. :attr:`failure` is None while the server is healthy, else why it was
    stopped (see the module docstring).
    """

    def __init__(self, repo: os.PathLike | str, http_port: int, grpc_port: int, metrics_port: Optional[int] = None,
                 *, host: str = DEFAULT_HOST, workdir: Optional[os.PathLike | str] = None,
                 startup_timeout: float = 120.0, exit_timeout: int = 10, log_verbose: int = 0,
                 extra_args: Sequence[str] = (), stub_site: Optional[os.PathLike | str] = None):
        self.repo = pathlib.Path(repo).resolve()
        if not self.repo.is_dir():
            raise TritonLaunchError(f"--repo {self.repo} is not a directory; pass a Triton model repository "
                                    "(e.g. one written by `k3deploy repository` or `k3deploy build`)")
        ports = [p for p in (http_port, grpc_port, metrics_port) if p is not None]
        for name, p in (("http_port", http_port), ("grpc_port", grpc_port), ("metrics_port", metrics_port)):
            if p is not None and not (0 < int(p) < 65536):
                raise TritonLaunchError(f"{name}={p} is not a TCP port; pass 1..65535")
        if len(set(ports)) != len(ports):
            raise TritonLaunchError(f"ports must differ: http={http_port} grpc={grpc_port} metrics={metrics_port}")
        self.http_port, self.grpc_port, self.metrics_port = int(http_port), int(grpc_port), metrics_port
        self.host = host
        self.startup_timeout = startup_timeout
        self.exit_timeout = int(exit_timeout)
        self.log_verbose = int(log_verbose)
        self.extra_args = list(extra_args)
        self.stub_site = pathlib.Path(stub_site) if stub_site is not None else None
        self._own_workdir = workdir is None
        self._workdir_arg = pathlib.Path(workdir) if workdir is not None else None
        self.workdir: Optional[pathlib.Path] = None
        self.log_path: Optional[pathlib.Path] = None
        self._log_file = None
        self._proc: Optional[subprocess.Popen] = None
        self._shm_prefix: Optional[str] = None
        self.returncode: Optional[int] = None
        self._final_log = ""
        self.failure: Optional[str] = None
        self._internal_http: Optional[int] = None
        self._front = None
        self._watcher: Optional[threading.Thread] = None
        self._stop_watch = threading.Event()
        self._sweeper: Optional[subprocess.Popen] = None

    # -- endpoints ---------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint (the form tritonclient.http expects)."""
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint (the form tritonclient.grpc expects)."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> Optional[str]:
        """Full URL of the Prometheus metrics page, or ``None`` when metrics are disabled."""
        return None if self.metrics_port is None else f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> Optional[int]:
        """Process id of the running server, if started."""
        return None if self._proc is None else self._proc.pid

    def command(self, backends: pathlib.Path) -> list[str]:
        """The full ``tritonserver`` command line (with the shared-memory prefix :meth:`start` chose)."""
        dist = find_distribution()
        cmd = [
            str(dist.binary),
            f"--model-repository={self.repo}",
            f"--backend-directory={backends}",
            f"--cache-directory={dist.caches}",
            f"--http-address={self.host}", f"--http-port={self._internal_http or self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            "--allow-sagemaker=false", "--allow-vertex-ai=false",
            "--exit-on-error=true", "--strict-readiness=true",
            f"--exit-timeout-secs={self.exit_timeout}",
            f"--log-verbose={self.log_verbose}",
            # A private shared-memory prefix lets several servers (e.g. parallel tests) coexist.
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
        ]
        if self.metrics_port is None:
            cmd.append("--allow-metrics=false")
        else:
            cmd += ["--allow-metrics=true", f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}"]
        return cmd + self.extra_args

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, wait: bool = True, timeout: Optional[float] = None) -> "TritonServer":
        """Start the server; with ``wait`` (default) block until it is ready (see :meth:`wait_ready`).

        Raises:
            TritonLaunchError: a port is taken (naming the process holding it), the distribution is incomplete,
                or (``wait``) the server did not become ready.
        """
        if self._proc is not None and self._proc.poll() is None:
            raise TritonLaunchError(f"server already running (pid {self._proc.pid}); call stop() first")
        if self._proc is not None:          # exited but not stopped: clean up after it before a new run
            self.stop()
        check_ports_free(self.host, {"--http-port": self.http_port, "--grpc-port": self.grpc_port,
                                     **({"--metrics-port": self.metrics_port} if self.metrics_port else {})})
        dist = find_distribution()
        if self._own_workdir:
            self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="k3serve_"))
        else:
            self.workdir = self._workdir_arg.resolve()
            self.workdir.mkdir(parents=True, exist_ok=True)
        backends = prepare_backends(dist, self.workdir)
        python_bin = prepare_python_env(self.workdir, self.stub_site)
        self._shm_prefix = f"k3serve_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self._internal_http = free_ports(1, self.host)[0]
        self.failure = None
        from k3deploy.serve.front import Front
        try:
            self._front = Front(self.host, self.http_port, f"{self.host}:{self._internal_http}",
                                self.grpc_url).start()
        except OSError as e:
            raise TritonLaunchError(f"--http-port {self.http_port}: cannot serve the HTTP front on "
                                    f"{self.host}:{self.http_port} ({e.strerror or e})") from e
        cmd = self.command(backends)
        self.log_path = self.workdir / "tritonserver.log"
        self._log_file = open(self.log_path, "wb")
        LOGGER.info("starting tritonserver: %s", " ".join(cmd))
        self._proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=server_env(dist, python_bin), cwd=self.workdir, start_new_session=True,
                                      preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        self._sweeper = subprocess.Popen([sys.executable, "-S", "-c", _SWEEPER, str(os.getpid()), str(self._proc.pid),
                                          self._shm_prefix], stdin=subprocess.DEVNULL, start_new_session=True)
        self.returncode = None
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop()
                raise
        return self

    def is_alive(self) -> bool:
        """True while the server process runs."""
        return self._proc is not None and self._proc.poll() is None

    def is_ready(self) -> bool:
        """True when ``GET /v2/health/ready`` answers 200 on the public HTTP port (the front: false once failed)."""
        return _http_ok(f"http://{self.http_url}/v2/health/ready")

    def _triton_ready(self) -> bool:
        """tritonserver's own readiness (its internal HTTP port): never another process's answer."""
        return self._internal_http is not None and _http_ok(f"http://{self.host}:{self._internal_http}/v2/health/ready")

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Block until the server is ready, then start supervising it.

        Raises:
            TritonLaunchError: the process exited, or ``timeout`` (default ``startup_timeout``) seconds
                passed; the message carries the tail of the server log.
        """
        if self._proc is None:
            raise TritonLaunchError("server not started; call start() first")
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if self.poll_ready():
                return
            if time.monotonic() > deadline:
                raise TritonLaunchError(f"tritonserver not ready after {timeout:.0f}s (repo {self.repo}); "
                                        f"raise the timeout if models load slowly. Server log tail:\n{self.log_tail()}")
            time.sleep(0.2)

    def poll_ready(self) -> bool:
        """One readiness check of tritonserver itself; on the first success start supervising it. Raises
        TritonLaunchError (with the log tail) when it exited before becoming ready."""
        if self._proc is None:
            raise TritonLaunchError("server not started; call start() first")
        rc = self._proc.poll()
        if rc is not None and self._watcher is None:
            raise TritonLaunchError(f"tritonserver exited with code {rc} before becoming ready "
                                    f"(repo {self.repo}). Server log tail:\n{self.log_tail()}")
        if self._watcher is not None:
            return self.failure is None
        if not self._triton_ready():
            return False
        LOGGER.info("tritonserver ready: http=%s grpc=%s metrics=%s", self.http_url, self.grpc_url, self.metrics_url)
        self._supervise()
        return True

    # -- supervision -------------------------------------------------------------------------------
    def _supervise(self) -> None:
        """Start the watcher over tritonserver and the stubs it has now (the models are loaded)."""
        if self._watcher is not None and self._watcher.is_alive():
            return
        self._stop_watch.clear()
        stubs = {pid: _stub_model(pid) for pid in _stubs(self._proc.pid, self._shm_prefix) if pid != self._proc.pid}
        LOGGER.info("supervising tritonserver pid %d and Python backend stubs %s", self._proc.pid,
                    ", ".join(f"{pid} ({m})" for pid, m in stubs.items()) or "none")
        self._watcher = threading.Thread(target=self._watch, args=(self._proc, stubs), name="k3-supervisor",
                                         daemon=True)
        self._watcher.start()

    def _watch(self, proc: subprocess.Popen, stubs: dict) -> None:
        while not self._stop_watch.wait(WATCH_INTERVAL_S):
            rc = proc.poll()
            if rc is not None:
                how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
                self._fail(f"tritonserver {how}")
                return
            alive = set(_stubs(proc.pid, self._shm_prefix)) - {proc.pid}      # its command line has the prefix too
            dead = [pid for pid in stubs if pid not in alive]
            if dead:
                self._fail("; ".join(f"the Python backend stub of model {stubs[pid]!r} (pid {pid}) died" for pid in dead)
                           + " (killed, crashed, or ended itself on a fatal engine error: see the server log)")
                return
            for pid in alive - set(stubs):              # a stub started later (a model loaded later)
                stubs[pid] = _stub_model(pid)

    def _fail(self, reason: str) -> None:
        """The server is broken: record why, fail readiness and what is in flight, kill tritonserver's group."""
        if self.failure is not None:
            return
        self.failure = reason
        LOGGER.error("server failed: %s; stopping tritonserver. Server log tail:\n%s", reason, self.log_tail(20))
        if self._front is not None:
            self._front.fail(reason)
        if self._proc is not None and self._proc.poll() is None:
            _signal_group(self._proc.pid, signal.SIGKILL)

    def log_text(self) -> str:
        """The whole server log so far (kept after :meth:`stop` removes a temporary workdir)."""
        if self.log_path is not None and self.log_path.exists():
            try:
                self._log_file and self._log_file.flush()
            except ValueError:
                pass
            return self.log_path.read_text(errors="replace")
        return self._final_log

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout: Optional[float] = None) -> Optional[int]:
        """Stop the server: SIGTERM, wait up to ``timeout`` (default ``exit_timeout`` + 15 s), then SIGKILL
        its process group (the server not yet reaped: the group is still ours); then end the Python backend's stubs
        that outlived the server (tritonserver exiting on an error orphans them: `_end_stubs`) and remove the
        shared-memory regions of this server's prefix. Removes a temporary workdir. Returns the server's exit
        code. Idempotent. The HTTP front and the supervisor stop first (a stop is no failure)."""
        self._stop_watch.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5)
        self._watcher = None
        if self._front is not None:                  # its connections would hold tritonserver's exit up
            self._front.stop()
            self._front = None
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                LOGGER.info("stopping tritonserver (pid %d)", proc.pid)
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=self.exit_timeout + 15 if timeout is None else timeout)
                except subprocess.TimeoutExpired:
                    LOGGER.warning("tritonserver (pid %d) ignored SIGTERM; killing its process group", proc.pid)
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait()
            self.returncode = proc.returncode
            if self._shm_prefix:
                _end_stubs(proc.pid, self._shm_prefix)
                _remove_shm(self._shm_prefix)
            self._proc = None
        if self._sweeper is not None:
            self._sweeper.kill()
            self._sweeper.wait()
            self._sweeper = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.workdir is not None:
            if self.log_path is not None and self.log_path.exists():
                self._final_log = self.log_path.read_text(errors="replace")
            if self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.log_path = None
            self.workdir = None
        return self.returncode

    def __enter__(self) -> "TritonServer":
        if not self.is_alive():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class OpenAIFront:
    """The OpenAI-compatible front (``python -m k3deploy.serve.openai``) as a child process.

    Args:
        grpc_url: the Triton gRPC endpoint ``host:port``; port / host: where the front listens (loopback default);
        api_key / served_model / allowed_media_hosts / max_request_bytes: passed on (``--api-key``,
            ``--served-model-name``, ``--allowed-media-hosts``, ``--max-request-bytes``; None: the front's default);
            log_path: its output (default inherited).
    """

    def __init__(self, grpc_url: str, port: int, *, host: str = DEFAULT_HOST, api_key: Optional[str] = None,
                 served_model: Optional[str] = None, log_path: Optional[os.PathLike | str] = None,
                 allowed_media_hosts: Sequence[str] = (), max_request_bytes: Optional[int] = None):
        if not 0 < int(port) < 65536:
            raise TritonLaunchError(f"openai_port={port} is not a TCP port; pass 1..65535")
        self.grpc_url, self.port, self.host = grpc_url, int(port), host
        self.api_key, self.served_model = api_key, served_model
        self.allowed_media_hosts = [h for h in allowed_media_hosts if h]
        self.max_request_bytes = max_request_bytes
        self.log_path = pathlib.Path(log_path) if log_path is not None else None
        self._proc: Optional[subprocess.Popen] = None
        self._log = None

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (``http://host:port/v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 120.0) -> "OpenAIFront":
        """Start the front and wait until ``/health`` answers 200. Raises TritonLaunchError when it exits or
        times out (with its log tail when logging to a file)."""
        root = str(pathlib.Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + ([os.environ["PYTHONPATH"]]
                                                                    if os.environ.get("PYTHONPATH") else [])))
        cmd = [sys.executable, "-m", "k3deploy.serve.openai", "--triton-grpc", self.grpc_url, "--host", self.host,
               "--port", str(self.port), "--timeout", str(timeout)]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.served_model:
            cmd += ["--served-model-name", self.served_model]
        if self.allowed_media_hosts:
            cmd += ["--allowed-media-hosts", ",".join(self.allowed_media_hosts)]
        if self.max_request_bytes is not None:
            cmd += ["--max-request-bytes", str(self.max_request_bytes)]
        if self.log_path is not None:
            self._log = open(self.log_path, "wb")
        LOGGER.info("starting the OpenAI front: %s", " ".join(c if c != self.api_key else "***" for c in cmd))
        self._proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT if self._log else None, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:] if self.log_path else ""
                self.stop()
                raise TritonLaunchError(f"the OpenAI front exited with code {self._proc_rc} before it was ready\n{tail}")
            try:
                with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        LOGGER.info("OpenAI front ready: %s", self.url)
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TritonLaunchError(f"the OpenAI front was not ready after {timeout:.0f}s")
            time.sleep(0.2)

    _proc_rc: Optional[int] = None

    @property
    def pid(self) -> Optional[int]:
        """Process id of the running front, if started."""
        return None if self._proc is None else self._proc.pid

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 15.0) -> Optional[int]:
        """SIGTERM, up to `timeout` seconds, then SIGKILL its process group. Returns the exit code. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    LOGGER.warning("the OpenAI front (pid %d) ignored SIGTERM; killing it", proc.pid)
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait()
            self._proc_rc = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return self._proc_rc

    def __enter__(self) -> "OpenAIFront":
        return self.start() if not self.is_alive() else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stub_model(pid: int) -> str:
    """The model a Python backend stub serves: <repo>/<model>/<version>/model.py is its first argument."""
    try:
        arg = (pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") + [b"", b""])[1].decode()
        return pathlib.Path(arg).parent.parent.name or "?"
    except OSError:
        return "?"


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to process group `pgid`; False when the group has no process left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _stubs(pgid: int, marker: str) -> list[int]:
    """Live (not zombie) processes of process group `pgid` whose command line carries `marker` — the server's
    shared-memory prefix, which tritonserver passes to every Python backend stub it starts (Linux /proc). Matching
    both, never a bare group id, keeps a reused pid from being signalled once the server itself is reaped."""
    found = []
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]      # "pid (comm) state ppid pgrp .."
            if int(pgrp) == pgid and state != "Z" and marker.encode() in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except (OSError, ValueError):
            pass
    return found


def _signal_stub(pid: int, marker: str, sig: int) -> None:
    """Send `sig` to stub `pid` through a pidfd taken before re-checking its command line, so that a pid reused
    in between is never signalled (falls back to kill() where pidfds are missing)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):
        fd = None
    try:
        if marker.encode() in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
            signal.pidfd_send_signal(fd, sig) if fd is not None else os.kill(pid, sig)
    except OSError:             # gone meanwhile (ProcessLookupError), or not ours to signal
        pass
    finally:
        if fd is not None:
            os.close(fd)


def _end_stubs(pgid: int, marker: str, grace: float = 5.0) -> None:
    """End the stubs of the server's group `pgid` that outlived it (`_stubs`): SIGTERM, up to `grace` seconds,
    then SIGKILL, and up to 1 s for them to go."""
    left = _stubs(pgid, marker)
    if not left:
        return
    LOGGER.warning("Python backend stubs %s outlived tritonserver; ending them", left)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0)):
        for pid in left:
            _signal_stub(pid, marker, sig)
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = _stubs(pgid, marker)
        if not left:
            return


def _remove_shm(prefix: str) -> None:
    """Unlink the shared-memory regions named with a server's prefix (left behind by killed stubs)."""
    for f in pathlib.Path("/dev/shm").glob(prefix + "*"):
        LOGGER.info("removing leftover shared memory %s", f)
        f.unlink(missing_ok=True)


def _parse_args(argv: Optional[Sequence[str]] = None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog or "python -m k3deploy.serve.launch",
        description="Run the tritonserver bundled in nvidia-pytriton against a model repository, bound to "
                    "127.0.0.1, behind an HTTP front (request bodies <= 3 MiB, JSON checked, disconnects cancel); "
                    "refuses ports already taken (naming the process), prints the endpoints once ready, stops "
                    "cleanly on SIGINT/SIGTERM (exit 0), and exits 1 naming the reason when tritonserver or a model's "
                    "Python-backend stub dies (tritonserver never outlives this launcher). docs/OPERATIONS.md")
    p.add_argument("--repo", required=True,
                   help="Triton model repository (written by `k3deploy build` or `k3deploy repository`)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="serve a copy of --repo with prefix caching on in its k3 model (LLM(enable_prefix_caching="
                        "True): multi-turn chats and shared system prompts reuse cached KDA state and latent blocks; "
                        "docs/PREFIX_CACHING.md); the repository itself is not changed")
    p.add_argument("--num-snapshots", type=int, default=None,
                   help="with --enable-prefix-caching: KDA snapshot pool rows (default: the repository's, else "
                        "2 x max_batch)")
    p.add_argument("--snapshot-interval", type=int, default=None,
                   help="with --enable-prefix-caching: tokens between periodic KDA snapshots, a multiple of the "
                        "latent block size (16 on the CPU, 64 on CUDA, the engines' for tensorrt; the model refuses "
                        "another when it loads) (default: the repository's, else 1024 rounded up to one)")
    p.add_argument("--http-port", type=int, default=None, help="HTTP/REST port (default: a free one)")
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default: a free one)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus metrics port (omit: metrics off)")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind every endpoint to (default %(default)s)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness (default %(default)s)")
    p.add_argument("--exit-timeout", type=int, default=10,
                   help="seconds the server may drain in-flight requests on shutdown (default %(default)s)")
    p.add_argument("--workdir", default=None, help="keep copied backends and tritonserver.log here (default: temp)")
    p.add_argument("--stub-site", default=None,
                   help="directory holding numpy<2 for the Python-backend stub when the environment has numpy>=2 "
                        f"(default ${STUB_SITE_ENV} or ~/.cache/k3deploy/triton-stub-site/pyX.Y)")
    p.add_argument("--openai-port", type=int, default=None,
                   help="also run the OpenAI-compatible front (serve/openai.py) on this port")
    p.add_argument("--openai-host", default=DEFAULT_HOST, help="address the front binds to (default %(default)s)")
    p.add_argument("--api-key", default=None, help="the front requires 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", default=None, help="model name the front serves (default k3)")
    p.add_argument("--allowed-media-hosts", default="",
                   help="comma-separated hosts (or host:port) whose http(s) image URLs the front may fetch "
                        "(default: none; images come as data: URLs)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body the front accepts; larger ones get 413 (default 8 MiB)")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--log-level", default="INFO", help="launcher logging level (default %(default)s)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None, prog: str | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    args = _parse_args(argv, prog)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop_event = threading.Event()
    received: list[int] = []

    def _on_signal(signum, _frame):
        received.append(signum)
        stop_event.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    front: Optional[OpenAIFront] = None
    repo, copied = args.repo, None
    try:
        if args.enable_prefix_caching or args.num_snapshots is not None or args.snapshot_interval is not None:
            from k3deploy.serve.repository import RepositoryError, check_prefix_caching, with_prefix_caching
            try:
                check_prefix_caching(args.enable_prefix_caching, args.num_snapshots, args.snapshot_interval)
                copied = pathlib.Path(tempfile.mkdtemp(prefix="k3repo_"))
                repo = with_prefix_caching(args.repo, copied / "repository", args.num_snapshots,
                                           args.snapshot_interval)
            except RepositoryError as e:
                raise TritonLaunchError(str(e)) from e
            LOGGER.info("serving %s with prefix caching on (a copy in %s)", args.repo, repo)
        if args.openai_port is not None:
            check_ports_free(args.openai_host, {"--openai-port": args.openai_port})
        free = iter(free_ports(2, args.host))
        http_port = args.http_port if args.http_port is not None else next(free)
        grpc_port = args.grpc_port if args.grpc_port is not None else next(free)
        server = TritonServer(repo, http_port, grpc_port, args.metrics_port, host=args.host,
                              workdir=args.workdir, startup_timeout=args.timeout, exit_timeout=args.exit_timeout,
                              log_verbose=args.log_verbose, stub_site=args.stub_site)
        server.start(wait=False)
    except TritonLaunchError as e:
        LOGGER.error("%s", e)
        if copied is not None:
            shutil.rmtree(copied, ignore_errors=True)
        return 2
    try:
        deadline = time.monotonic() + args.timeout
        while not server.poll_ready():                # raises (with the log tail) if it exits first
            if stop_event.is_set():
                return 0
            if time.monotonic() > deadline:
                server.wait_ready(timeout=0)  # raises with the log tail
            time.sleep(0.2)
        # The endpoints are this CLI's output (stdout), one per line, machine-readable.
        print(f"http    http://{server.http_url}", flush=True)
        print(f"grpc    {server.grpc_url}", flush=True)
        if server.metrics_url:
            print(f"metrics {server.metrics_url}", flush=True)
        if args.openai_port is not None:
            front = OpenAIFront(server.grpc_url, args.openai_port, host=args.openai_host, api_key=args.api_key,
                                served_model=args.served_model_name,
                                allowed_media_hosts=args.allowed_media_hosts.split(","),
                                max_request_bytes=args.max_request_bytes).start(timeout=args.timeout)
            print(f"openai  {front.url}", flush=True)
        print("ready", flush=True)
        while not stop_event.wait(0.5):
            if server.failure is not None:
                LOGGER.error("exiting with status 1: %s", server.failure)
                return 1
            if front is not None and not front.is_alive():
                LOGGER.error("the OpenAI front exited unexpectedly (code %s)", front.stop())
                return 1
        LOGGER.info("received %s; shutting down", signal.Signals(received[0]).name)
        return 0
    except TritonLaunchError as e:
        LOGGER.error("%s", e)
        return 1
    finally:
        if front is not None:
            front.stop()
        rc = server.stop()
        LOGGER.info("tritonserver exited with code %s", rc)
        if copied is not None:
            shutil.rmtree(copied, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
