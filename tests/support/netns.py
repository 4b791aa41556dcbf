"""Hosts without a cluster: Linux network namespaces on one bridge, each with its own address.

A process started on a ``Host`` sees only its own interfaces (its address and loopback), as a
pod does: it reaches the others by their addresses across the bridge, never over 127.0.0.1.
Needs root and ``ip`` (iproute2); ``cannot_create_reason`` says why not where that is missing.
Everything is undone by ``close``: processes stopped by PID, namespaces and links deleted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def cannot_create_reason() -> str | None:
    """None when network namespaces can be created here, else why not."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"pdsprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as error:
        return f"`ip netns add` failed: {error.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    """One network namespace: its name, its address on the bridge, and what runs in it."""

    name: str
    namespace: str
    address: str
    processes: list[subprocess.Popen] = field(default_factory=list)
    link: str = ""  # its cable to the bridge (the veth end outside the namespace)


class Hosts:
    """A bridge in this namespace (so the test process is a host too) and namespaces hanging off it."""

    def __init__(self) -> None:
        self._tag = f"{os.getpid() % 100000}{uuid.uuid4().hex[:2]}"
        # A /24 unlikely to be in use: 10.(200..249).(0..249).0
        seed = int(uuid.uuid4().hex[:6], 16)
        self._prefix = f"10.{200 + seed % 50}.{(seed >> 8) % 250}"
        self.bridge = f"pdb{self._tag}"
        self.gateway_address = f"{self._prefix}.1"  # this process's address on the bridge
        self.hosts: dict[str, Host] = {}
        self._links: list[str] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except subprocess.CalledProcessError:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            raise

    def add(self, name: str) -> Host:
        index = len(self.hosts) + 10
        namespace, link = f"pdn{self._tag}{index}", f"pdv{self._tag}{index}"
        _ip("netns", "add", namespace)
        host = Host(name, namespace, f"{self._prefix}.{index}", link=link)
        self.hosts[name] = host
        _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
        self._links.append(link)
        _ip("link", "set", f"{link}p", "netns", namespace)
        _ip("link", "set", link, "master", self.bridge, "up")
        _ip("-n", namespace, "addr", "add", f"{host.address}/24", "dev", f"{link}p")
        _ip("-n", namespace, "link", "set", f"{link}p", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        return host

    def partition(self, host: Host, cut: bool = True) -> None:
        """Cut ``host`` off the bridge (its packets dropped, its processes running), or (``cut`` False) heal it."""
        _ip("link", "set", host.link, "down" if cut else "up")

    def start(self, host: Host, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Run ``argv`` inside ``host``'s namespace; ``ip netns exec`` execs it, so the PID is the process's own."""
        with open(log, "ab") as out:
            process = subprocess.Popen(["ip", "netns", "exec", host.namespace, *argv], env=env, stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        host.processes.append(process)
        return process

    def close(self) -> None:
        processes = [process for host in self.hosts.values() for process in host.processes if process.poll() is None]
        for process in processes:  # all drain at once, then each is waited for (and killed if it hangs)
            process.send_signal(signal.SIGTERM)
        for process in processes:
            stop(process)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        for link in self._links:  # gone with their namespace's peer already, normally
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def stop(process: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; by PID."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
