"""The seccomp filter of namespace sandboxes, compiled by libseccomp (through the
`pyseccomp` ctypes binding) into the BPF program that `bwrap --seccomp FD` loads.

Everything is allowed except what would let a command rearrange or leave its
namespaces, reach into other processes, or touch kernel facilities that have been
the usual way out of sandboxes; those fail with EPERM. clone3 fails with ENOSYS
(its flags sit in memory a filter cannot read), so the C library falls back to
clone, whose namespace flags are checked. The filter is for this machine's own
architecture; libseccomp kills any system call made through another ABI (e.g. i386
on x86_64), so that no second syscall table slips past it."""

from __future__ import annotations

import errno
import os
import platform

from retrograd.rollouts.sandbox.base import SandboxError

REFUSED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick",  # namespaces and mounts
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",  # other processes
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "syslog", "acct", "quotactl", "swapon", "swapoff", "reboot", "open_by_handle_at",
    "name_to_handle_at",  # kernel facilities
)
NAMESPACE_FLAGS = {  # clone(2) flags that make a new namespace (linux/sched.h)
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080,
}


def compile_filter() -> bytes:
    """The BPF program, ready for `bwrap --seccomp`."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError, RuntimeError) as error:  # pyseccomp raises when libseccomp.so is missing
        raise SandboxError(f"[agent.environment] type = 'sandbox' needs libseccomp for its system call filter "
                           f"({error}); install it (Debian/Ubuntu: apt-get install -y libseccomp2)") from None
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in REFUSED:
        try:
            rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except OSError:  # a call this libseccomp does not know (EINVAL)
            continue
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    flags_arg = 1 if platform.machine().startswith("s390") else 0  # s390 swaps clone's first two arguments
    for flag in NAMESPACE_FLAGS.values():
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(flags_arg, seccomp.MASKED_EQ, flag, flag))
    program = os.memfd_create("retrograd-seccomp")
    try:
        with open(program, "wb", closefd=False) as sink:
            rules.export_bpf(sink)
        return os.pread(program, os.fstat(program).st_size, 0)
    finally:
        os.close(program)
