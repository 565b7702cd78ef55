"""An emulated cluster on one Linux machine: network namespaces as nodes, a veth NIC per rank through a bridge, each
shaped to --gbit each way, a CPU-quota cgroup per rank. Needs root (CAP_NET_ADMIN); whatever happens, it removes all
it made and touches nothing else (bench/README.md, "An emulated cluster", says what it builds and why).

    with Net(nodes=2, gbit=1.0, delay_ms=0.2, ranks=4, rails=2) as net:  # builds; tears down on exit, error, signal
        net.popen(0, ["ip", "addr"])                                         # a process inside node 0
"""
import os
import re
import secrets
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.77"
NAME_RE = re.compile(r"^npc(\d+)x[0-9a-f]+(-|$)")
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 2_000  # the quota's period: a rank runs its share of every 2 ms (a peer is never throttled long)


class NetError(RuntimeError):
    pass


def can_admin_net():
    """True when this process may create namespaces and links (root, or CAP_NET_ADMIN with ip installed)."""
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        have = int(caps.split()[1], 16) & (1 << 12)  # CAP_NET_ADMIN
    except (OSError, StopIteration, ValueError):
        have = os.geteuid() == 0
    return bool(have) and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


def sh(cmd, check=True, timeout=30):
    """Runs one command (a list); raises NetError with its stderr when it fails and check is set."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
        raise NetError(f"{' '.join(cmd)}: {p.stderr.strip() or p.returncode}")
    return p


def namespaces():
    """Every network namespace name on the machine."""
    out = sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def ours():
    """Namespaces this module made."""
    return [n for n in namespaces() if NAME_RE.match(n)]


def remove_namespace(name):
    """Kills what still runs inside, then deletes the namespace (its links and qdiscs go with it)."""
    pids = sh(["ip", "netns", "pids", name], check=False).stdout.split()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except (ProcessLookupError, ValueError):
                pass
        deadline = time.monotonic() + 3
        while pids and time.monotonic() < deadline:
            pids = sh(["ip", "netns", "pids", name], check=False).stdout.split()
            time.sleep(0.05)
        if not pids:
            break
    sh(["ip", "netns", "del", name], check=False)


def remove_cgroup(folder):
    """Kills what is left in each rank's cgroup, then removes them and the folder."""
    for sub in [*folder.glob("rank*"), folder]:
        for _ in range(50):
            pids = (sub / "cgroup.procs").read_text().split() if sub.exists() else []
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                sub.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # still busy: its last tasks are exiting
                time.sleep(0.05)


def remove_stale():
    """Namespaces and cgroups of ours whose creating process no longer exists (SIGKILLed before its teardown)."""
    for name in ours():
        if not os.path.exists(f"/proc/{NAME_RE.match(name).group(1)}"):
            remove_namespace(name)
    for folder in CPU_CGROUPS.glob("npc*") if CPU_CGROUPS.exists() else []:
        match = NAME_RE.match(folder.name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            remove_cgroup(folder)


def join_cpu_share(folder, rank):
    """Moves this process (all its threads, and those it starts later) into rank `rank`'s cgroup."""
    (Path(folder) / f"rank{rank}" / "cgroup.procs").write_text(str(os.getpid()))


class Net:
    """K namespaces joined by shaped links; a context manager that always removes what it made."""

    def __init__(self, nodes=2, gbit=1.0, delay_ms=0.2, ranks=0, rails=1):
        self.nodes, self.gbit, self.delay_ms, self.ranks, self.rails = nodes, gbit, delay_ms, ranks, rails
        self.prefix = f"npc{os.getpid()}x{secrets.token_hex(2)}"
        self.switch = f"{self.prefix}-sw"
        self.names = [f"{self.prefix}-n{k}" for k in range(nodes)]
        self.made, self.shaping, self.cgroups, self.cpu_share = [], None, None, None

    def addr(self, node, rail=0):
        return f"{SUBNET}.{rail}.{node + 1}"

    def ns(self, name, *cmd):
        return sh(["ip", "netns", "exec", name, *cmd])

    def _add(self, name):
        sh(["ip", "netns", "add", name])
        self.made.append(name)
        self.ns(name, "ip", "link", "set", "lo", "up")

    def _shape(self, name, dev):
        """netem (rate and delay) where the kernel has it, else tbf (rate only)."""
        rate = f"{self.gbit * 1000:g}mbit"
        netem = ["tc", "qdisc", "add", "dev", dev, "root", "netem", "rate", rate, "limit", "10000"]
        netem += ["delay", f"{self.delay_ms * 1000:g}us"] if self.delay_ms else []
        if self.shaping != "tbf":
            p = sh(["ip", "netns", "exec", name, *netem], check=False)
            if p.returncode == 0:
                self.shaping = "netem"
                return
            if self.shaping == "netem" or "unknown" not in p.stderr.lower():
                raise NetError(f"{' '.join(netem)}: {p.stderr.strip()}")
            self.shaping = "tbf"
        burst = max(64 * 1024, int(self.gbit * 1e9 / 8 * 1e-3))  # a millisecond at the rate, at least a GSO packet
        self.ns(name, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                "latency", "100ms")

    def __enter__(self):
        remove_stale()
        try:
            if self.ranks and (CPU_CGROUPS / "cpu.cfs_quota_us").exists():
                self.cgroups, self.cpu_share = CPU_CGROUPS / self.prefix, len(os.sched_getaffinity(0)) / self.ranks
                for r in range(self.ranks):
                    (self.cgroups / f"rank{r}").mkdir(parents=True)
                    (self.cgroups / f"rank{r}" / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                    (self.cgroups / f"rank{r}" / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * self.cpu_share)))
            self._add(self.switch)
            self.ns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            self.ns(self.switch, "ip", "link", "set", "br0", "up")
            for k, name in enumerate(self.names):
                self._add(name)  # each NIC answers ARP for its own address only, so rail J's traffic stays on rail J
                self.ns(name, "sysctl", "-qw", "net.ipv4.conf.all.arp_ignore=1", "net.ipv4.conf.all.arp_announce=2")
                for j in range(self.rails):
                    port, nic = f"v{k}r{j}", f"eth{j}"
                    self.ns(self.switch, "ip", "link", "add", port, "type", "veth", "peer", "name", nic, "netns", name)
                    self.ns(self.switch, "ip", "link", "set", port, "master", "br0", "up")
                    self.ns(name, "ip", "addr", "add", f"{self.addr(k, j)}/24", "dev", nic)
                    self.ns(name, "ip", "link", "set", nic, "up")
                    self._shape(name, nic)
                    self._shape(self.switch, port)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for name in reversed(self.made):
            remove_namespace(name)
        self.made = []
        if self.cgroups is not None and self.cgroups.exists():
            remove_cgroup(self.cgroups)

    def sent_bytes(self):
        """Bytes each node has sent over its NICs so far (their qdiscs' counters)."""
        out = []
        for name in self.names:
            text = self.ns(name, "tc", "-s", "qdisc", "show").stdout
            out.append(sum(int(n) for dev, n in re.findall(r"dev (\S+) root.*?\n Sent (\d+) bytes", text)
                           if dev.startswith("eth")))
        return out

    def popen(self, node, cmd, **kw):
        """A process inside node `node`'s network namespace (subprocess.Popen keywords pass through). nsenter, not
        `ip netns exec`, which remounts /sys and so hides the cgroups a rank joins."""
        return subprocess.Popen(["nsenter", f"--net=/run/netns/{self.names[node]}", "--", *cmd], **kw)
