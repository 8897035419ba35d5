"""PID 1 of a namespace sandbox (namespace.py): runs each command the host asks for,
inside the sandbox's namespaces, mounts and seccomp filter, and sweeps up after it.

It runs under the sandbox's own python3 (`python3 -I -S <a read-only copy>`), so it uses
the standard library only and works on Python >= 3.8. Protocol on a SOCK_SEQPACKET
socket to the host (config "control_fd"): the launcher first sends b"ready"; each request
is JSON {"argv": [...], "cpu": seconds} carrying four fds (stdin, stdout, stderr,
status); b"kill" SIGKILLs every process of the sandbox. When the command has ended
the launcher SIGKILLs whatever it left behind, reaps it all, writes the exit status
(128 + N for signal N) to the status fd and closes it. argv[1] is JSON config:
"control_fd", "rlimits" and "env" for each command, and "watch_bytes" (0: off), the
memory bound the watchdog enforces when the host has no cgroup for the sandbox.

As PID 1 of its PID namespace it cannot be killed or stopped from inside, and it
makes itself non-dumpable so that no command (same uid) can open its /proc/1/mem."""

import ctypes
import json
import os
import resource
import selectors
import signal
import socket
import sys

WATCH_SECS = 0.05  # how often the watchdog sums the sandbox's memory while a command runs
PR_SET_DUMPABLE = 4


def main():
    config = json.loads(sys.argv[1])
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.exit("launcher: prctl(PR_SET_DUMPABLE) failed")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    os.set_inheritable(config["control_fd"], False)
    control = socket.socket(fileno=config["control_fd"])
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    control.send(b"ready")
    while True:
        message, fds = receive(control)
        if message is None:
            return
        if fds:
            if not run(json.loads(message), fds, config, control, selector, wake_read):
                return


def run(request, fds, config, control, selector, wake_read):
    """One command, to its end and its sweep. False when the host has gone."""
    pid = os.fork()
    if pid == 0:
        child(request, fds, config)
    for fd in fds[:3]:
        os.close(fd)
    host_here, status = True, None
    while status is None:
        for key, _ in selector.select(WATCH_SECS if config["watch_bytes"] else None):
            if key.fileobj is control:
                message, extra = receive(control)
                for fd in extra:
                    os.close(fd)
                host_here = message is not None
                kill_all()  # b"kill", or the host is gone
            else:
                os.read(wake_read, 4096)
        status = reap(pid)
        if config["watch_bytes"] and status is None and memory_used() > config["watch_bytes"]:
            kill_all()
    kill_all()
    reap_all()
    os.write(fds[3], str(status).encode())
    os.close(fds[3])
    return host_here


def child(request, fds, config):
    try:
        for number in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them, and exec keeps that
            signal.signal(number, signal.SIG_DFL)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for name, value in config["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
        resource.setrlimit(resource.RLIMIT_CPU, (request["cpu"], request["cpu"]))
        argv = request["argv"]
        try:
            os.execvpe(argv[0], argv, config["env"])
        except FileNotFoundError:
            os.write(2, f"{argv[0]}: command not found\n".encode())
            os._exit(127)
        except OSError as error:
            os.write(2, f"{argv[0]}: {error.strerror}\n".encode())
    finally:
        os._exit(126)


def receive(control):
    """(message, fds) of one request; (None, []) when the host has closed the socket."""
    fd_space = socket.CMSG_SPACE(4 * ctypes.sizeof(ctypes.c_int))
    message, ancillary, _, _ = control.recvmsg(1 << 20, fd_space, socket.MSG_CMSG_CLOEXEC)
    fds = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += [int.from_bytes(data[i:i + 4], sys.byteorder) for i in range(0, len(data) - 3, 4)]
    return (message or None), fds


def reap(pid):
    """Reaps every finished process (PID 1 inherits orphans); the exit status of `pid` once it ended."""
    status = None
    while True:
        try:
            finished, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if finished == 0:
            return status
        if finished == pid:
            status = exit_code(wait_status)


def reap_all():
    """Waits until no process but this one is left (every process here descends from PID 1)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def kill_all():
    try:
        os.kill(-1, signal.SIGKILL)  # from PID 1: every process of the namespace but itself
    except ProcessLookupError:
        pass


def exit_code(wait_status):
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def memory_used():
    """Resident memory of every process here, plus what the tmpfs mounts and System V
    shared memory hold, in bytes: an upper bound (shared pages count once per process)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/statm") as statm:
                    total += int(statm.read().split()[1]) * page
            except (OSError, IndexError, ValueError):
                pass  # ended meanwhile
    for mount in ("/work", "/tmp", "/dev/shm"):
        usage = os.statvfs(mount)
        total += (usage.f_blocks - usage.f_bfree) * usage.f_frsize
    try:
        with open("/proc/sysvipc/shm") as segments:
            next(segments)
            total += sum(int(line.split()[14]) for line in segments if line.strip())
    except OSError:  # a kernel without System V IPC
        pass
    return total


if __name__ == "__main__":
    main()
