"""Run untrusted Python (model-generated code) in a contained child process and call its functions
(docs/lm-eval.md, "Running generated code"; what is contained, in full: eval_configs/README.md, "Scoring").

The trusted side (e.g. a HumanEval test) runs in *this* process and reaches the untrusted program in a child
through :class:`Sandbox` ``.define(program, entry_point)``, a callable: arguments out, the return value (or the
raised exception's name and message) back, both as Python literals (``ast.literal_eval``; never pickle). The
verdict is whatever the trusted code decides from those values: the child holds no secret and no verdict it
could print, forge or exit early with.

The child (``_sandbox_child.py``, standard library only) always has its own session, soft = hard resource limits
(:class:`Limits`), an empty work directory, no output and a deadline; where unprivileged user namespaces are
allowed, also no network, a read-only file system but its work directory, its own PID namespace and no
capabilities; as root, a pids cgroup (:mod:`psr_hf.eval.pids_cgroup`) caps its processes. What the machine does
not allow is listed in :attr:`Sandbox.not_contained`, and callers log it. Never contained: reading files the user
can read. Use a container or VM for hostile input at scale.
"""

from __future__ import annotations

import ast
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

CHILD = Path(__file__).with_name("_sandbox_child.py")
OPT_IN_VARIABLE = "HF_ALLOW_CODE_EVAL"  # the variable lm-eval's (and Hugging Face evaluate's) code_eval reads
MAX_REPLY_BYTES = 1 << 20  # a test's return value; more is refused before it is parsed
# separators and brackets in a reply (an upper bound on its literal's elements): parsing costs about 1 kB of the
# scorer's memory per element, so a reply of 1 MiB of "0," would cost the scorer 500 MB and seconds
MAX_REPLY_ITEMS = 100_000


def _load_encode():
    # the child's own encoder, so both sides write the same literals (the child module imports only stdlib)
    import importlib.util

    spec = importlib.util.spec_from_file_location("_psr_hf_sandbox_child", CHILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.encode


encode = _load_encode()


class CodeExecutionNotAllowed(PermissionError):
    """Generated code would run, and the user has not opted in."""


def require_opt_in(what: str) -> None:
    """Raise :class:`CodeExecutionNotAllowed` unless the user set ``HF_ALLOW_CODE_EVAL=1`` themselves."""
    if os.environ.get(OPT_IN_VARIABLE) != "1":
        raise CodeExecutionNotAllowed(
            f"{what} executes model-generated code, and {OPT_IN_VARIABLE} is not set to 1. Read what the sandbox "
            "contains and what it does not (eval_configs/README.md, psr_hf/eval/sandbox.py), then set "
            f"{OPT_IN_VARIABLE}=1 in your environment yourself (and pass --confirm_run_unsafe_code to lm-eval); no "
            "script of psr_hf sets it for you"
        )


@dataclass(frozen=True)
class Limits:
    """Resource limits of the child, each set as both soft and hard limit."""

    memory_bytes: int = 4 << 30  # RLIMIT_AS
    cpu_seconds: int = 10  # RLIMIT_CPU (the wall-clock deadline is separate)
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file it may write
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # RLIMIT_NPROC: tasks it may add (counted inside its user namespace when it has one)

    def __post_init__(self):
        for name in ("memory_bytes", "cpu_seconds", "file_bytes", "open_files", "processes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")
        if self.open_files < 8:
            raise ValueError(f"Limits.open_files must be at least 8 (the interpreter needs a few), got "
                             f"{self.open_files}")


class SandboxTimeout(BaseException):
    """The deadline passed before the child answered. A BaseException, so that no ``except Exception`` of the
    trusted code calling the candidate swallows it."""


class SandboxBroken(BaseException):
    """The child ended, or answered something that is not a reply of the protocol, before answering."""


class SandboxError(RuntimeError):
    """The sandbox itself could not start (not the untrusted program's doing)."""


class CandidateError(Exception):
    """The untrusted function raised; ``name`` and ``message`` are its exception's (as the child reported them)."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}" if message else name)
        self.name, self.message = name, message


class Sandbox:
    """One contained child process; a context manager. ``namespaces=False`` skips the namespaces (to test the
    fallback); otherwise they are used where the machine allows them."""

    def __init__(self, limits: Limits | None = None, namespaces: bool = True, startup_timeout: float = 60.0):
        self.limits = limits or Limits()
        self.deadline = float("inf")  # time.monotonic() value after which calls raise SandboxTimeout
        self.contained: list[str] = []
        self.not_contained: list[str] = []
        self._namespaces = namespaces
        self._startup_timeout = startup_timeout
        self._proc: subprocess.Popen | None = None
        self._workdir: str | None = None
        self._broken: BaseException | None = None
        self._buffer = b""

    # ------------------------------------------------------------------------------------------ life cycle
    def __enter__(self) -> "Sandbox":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        try:
            self._start()
        except SandboxError as exc:
            if not self._namespaces:
                raise
            # user namespaces granted but unusable, e.g. Ubuntu 24.04's AppArmor gives no capabilities in them:
            # go on without namespaces, and say why
            self._namespaces = False
            self._broken = None
            self._start()
            reason = str(exc).strip().splitlines()[-1][:300]
            self.not_contained = [item.replace("namespaces switched off", f"namespaces failed ({reason})")
                                  for item in self.not_contained]

    def _start(self) -> None:
        self._buffer = b""
        self._workdir = tempfile.mkdtemp(prefix="psr_sandbox_")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        self._poller = select.poll()
        self._poller.register(self._from_child, select.POLLIN | select.POLLHUP | select.POLLERR)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": self._workdir,
               "TMPDIR": self._workdir, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        config = {"fds": [to_child_r, from_child_w], "workdir": self._workdir, "namespaces": self._namespaces,
                  "limits": self.limits.__dict__, "env": env, "cgroup": None}
        cgroup_note = None
        if os.geteuid() == 0:  # the kernel does not enforce RLIMIT_NPROC for root: a pids cgroup does
            from . import pids_cgroup

            # the monitor and the worker, then the tasks the worker may add
            self._cgroup, why = pids_cgroup.create(self.limits.processes + 2)
            if self._cgroup is not None:
                config["cgroup"] = str(self._cgroup / "cgroup.procs")
                cgroup_note = (True, f"process count as root (pids cgroup: at most {self.limits.processes} tasks "
                                     "besides the monitor and the worker)")
            else:
                cgroup_note = (False, "process count: runs as root, which RLIMIT_NPROC does not limit, and no pids "
                                      f"cgroup could be made ({why})")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-s", "-P", str(CHILD), json.dumps(config)], cwd=self._workdir, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(to_child_r, from_child_w), start_new_session=True,
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        try:
            hello = self._receive(time.monotonic() + self._startup_timeout)
        except (SandboxTimeout, SandboxBroken) as exc:
            self.close()
            raise SandboxError(f"the sandbox's monitor did not start ({exc}): {self._stderr_tail}") from None
        if not (isinstance(hello, tuple) and len(hello) == 3 and hello[0] == "hello"):
            self.close()
            raise SandboxError(f"the sandbox's monitor said {hello!r} instead of hello")
        self.contained, self.not_contained = list(hello[1]), list(hello[2])
        if cgroup_note is not None and not any(item.startswith("process count") for item in self.not_contained):
            (self.contained if cgroup_note[0] else self.not_contained).append(cgroup_note[1])

    def close(self) -> None:
        """Kill the child and everything it started; remove the work directory."""
        self._stderr_tail = ""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)  # the monitor kills the worker and its descendants
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            try:  # whatever is left in the session, e.g. when the untrusted code stopped the monitor
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._proc.wait()
            self._stderr_tail = self._proc.stderr.read()[-2000:].decode("utf-8", "replace")
            self._proc.stderr.close()
            self._proc = None
        for fd in ("_to_child", "_from_child"):
            if getattr(self, fd, None) is not None:
                os.close(getattr(self, fd))
                setattr(self, fd, None)
        if self._workdir is not None:
            _remove_tree(self._workdir)
            self._workdir = None
        if getattr(self, "_cgroup", None) is not None:
            from . import pids_cgroup

            pids_cgroup.remove(self._cgroup)
            self._cgroup = None
        self._broken = self._broken or SandboxBroken("the sandbox is closed")

    # ------------------------------------------------------------------------------------------ protocol
    def define(self, program: str, entry_point: str) -> Callable[..., Any]:
        """Run ``program`` in the child and return a callable that calls its ``entry_point`` there. Raises
        :class:`CandidateError` if the program raised, :class:`SandboxTimeout` or :class:`SandboxBroken`."""
        self._expect(self._exchange(("define", program, entry_point)), "defined")

        def candidate(*args: Any, **kwargs: Any) -> Any:
            return self._expect(self._exchange(("call", args, kwargs)), "returned")[1]

        candidate.__name__ = candidate.__qualname__ = entry_point
        return candidate

    @property
    def broken(self) -> BaseException | None:
        """Why the child can no longer answer (timeout, exit, protocol violation), or None."""
        return self._broken

    def _exchange(self, message: tuple) -> Any:
        if self._broken is not None:
            raise self._broken
        try:
            data = (encode(message) + "\n").encode("utf-8")
        except (TypeError, ValueError) as exc:  # the trusted side passed something that is not a literal
            raise TypeError(f"only literal arguments reach the sandbox: {exc}") from None
        try:
            while data:
                data = data[os.write(self._to_child, data):]
        except BrokenPipeError:
            self._fail(SandboxBroken("the sandboxed process ended before answering"))
        return self._receive(self.deadline)

    def _expect(self, reply: Any, kind: str) -> tuple:
        if isinstance(reply, tuple) and reply and reply[0] == kind and len(reply) == (1 if kind == "defined" else 2):
            return reply
        if isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "raised" and all(
                isinstance(x, str) for x in reply[1:]):
            if reply[1] == "SandboxSetupError":
                self._fail(SandboxBroken(f"the sandbox could not start its worker: {reply[2]}"))
            raise CandidateError(reply[1], reply[2])
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "unsendable":
            raise CandidateError("TypeError", f"the function returned a value that is not a literal: {reply[1]}")
        self._fail(SandboxBroken(f"the sandboxed process answered out of protocol: {str(reply)[:200]}"))

    def _fail(self, exc: BaseException):
        self._broken = exc
        raise exc

    def _receive(self, deadline: float) -> Any:
        """The next reply line, read by ``ast.literal_eval``."""
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(SandboxTimeout("timed out"))
            if not self._poller.poll(int(min(left, 3600.0) * 1000) + 1):  # poll: any descriptor number
                continue
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                self._fail(SandboxBroken("the sandboxed process ended before answering"))
            self._buffer += chunk
            if len(self._buffer) > MAX_REPLY_BYTES:
                self._fail(SandboxBroken(f"the sandboxed process sent a reply over {MAX_REPLY_BYTES} bytes"))
        line, self._buffer = self._buffer.split(b"\n", 1)
        items = sum(line.count(c) for c in (b",", b"[", b"(", b"{", b":"))
        if items > MAX_REPLY_ITEMS:
            self._fail(SandboxBroken(f"the sandboxed process sent a reply of about {items} elements (at most "
                                     f"{MAX_REPLY_ITEMS} are parsed)"))
        try:
            return ast.literal_eval(line.decode("utf-8"))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, UnicodeDecodeError):
            self._fail(SandboxBroken("the sandboxed process answered something that is not a literal"))


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(function, name, _exc):
        try:
            os.chmod(os.path.dirname(name), 0o700)
            os.chmod(name, 0o700)
            function(name)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)
