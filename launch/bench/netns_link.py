"""Two emulated nodes on one machine joined by a truly slow link: network namespaces and a veth pair
shaped with ``tc`` (a token-bucket filter on each end, so both directions are limited).

    with TwoNodes(rate="1gbit") as nodes:
        nodes.popen(0, ["python", "-m", "pretrain", ...], env)   # a process on node 0

Traffic inside a namespace stays on its own loopback (intra-node, unshaped); traffic between the two
crosses the veth pair at ``rate``. Needs root (CAP_NET_ADMIN) and iproute2; made on entry and removed
on exit, touching nothing outside its two namespaces. ``probe`` measures what the link really carries
(TCP bytes per second, round-trip latency), which the link model is then given.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

from launch.tools.planning.link_model import parse_bandwidth

PROBE = r"""
import socket, sys, time
role, host, port, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role == "server":
    server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port)); server.listen(1); print("ready", flush=True)
    connection, _ = server.accept()
    for _ in range(100):  # ping-pong: the round trip
        connection.sendall(connection.recv(1))
    got = 0
    while got < size:
        got += len(connection.recv(1 << 20))
    connection.sendall(b"k")
else:
    connection = socket.create_connection((host, port)); connection.setsockopt(socket.IPPROTO_TCP,
                                                                               socket.TCP_NODELAY, 1)
    started = time.perf_counter()
    for _ in range(100):
        connection.sendall(b"p"); connection.recv(1)
    latency = (time.perf_counter() - started) / 200
    block, started = b"x" * (1 << 20), time.perf_counter()
    for _ in range(size >> 20):
        connection.sendall(block)
    connection.recv(1)
    print(size / (time.perf_counter() - started), latency)
"""


def link_sent(interface: str, namespace: str | None = None) -> tuple[int, int]:
    """(bytes, frames) ``interface`` (of ``namespace``; default: this process's own) has sent so far: its
    statistics, whole Ethernet frames with their headers."""
    where = ["-n", namespace] if namespace else []
    shown = subprocess.run(["ip", *where, "-s", "-j", "link", "show", "dev", interface],
                           capture_output=True, text=True, check=True).stdout
    sent = json.loads(shown)[0]["stats64"]["tx"]
    return sent["bytes"], sent["packets"]


class LinkSetupError(RuntimeError):
    """The namespaces cannot be made here (not root, no iproute2): says what is missing."""


class TwoNodes:
    """Owns two network namespaces, the veth pair between them and its shaping; never outlives its
    ``with`` block. Node i has address ``address(i)`` on interface ``interface(i)``."""

    def __init__(self, rate: str | None = None, subnet: str = "10.231.0"):
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise LinkSetupError("iproute2 (ip, tc) is not installed: the emulated link needs it")
        if os.geteuid() != 0:
            raise LinkSetupError("making network namespaces needs root (CAP_NET_ADMIN): run as root")
        tag = uuid.uuid4().hex[:6]
        self.namespaces = (f"zsl{tag}a", f"zsl{tag}b")
        self.interfaces = (f"zv{tag}a", f"zv{tag}b")
        self.rate, self.subnet = rate, subnet
        # the bucket holds a millisecond of traffic: a larger one refills while the ranks compute and lets
        # each collective's first burst through at the veth's own speed (a small model would never see the
        # rate)
        self.burst = f"{max(16 << 10, int(parse_bandwidth(rate) / 1000))}b" if rate else None

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def interface(self, node: int) -> str:
        return self.interfaces[node]

    def _ip(self, *args: str) -> None:
        result = subprocess.run(list(args), capture_output=True, text=True)
        if result.returncode:
            raise LinkSetupError(f"{' '.join(args)}: {result.stderr.strip()}")

    def __enter__(self) -> TwoNodes:
        try:
            for namespace in self.namespaces:
                self._ip("ip", "netns", "add", namespace)
            a, b = self.namespaces
            self._ip("ip", "link", "add", self.interfaces[0], "netns", a, "type", "veth", "peer", "name",
                     self.interfaces[1], "netns", b)
            for node, (namespace, interface) in enumerate(zip(self.namespaces, self.interfaces)):
                self._ip("ip", "-n", namespace, "addr", "add", f"{self.address(node)}/24", "dev", interface)
                self._ip("ip", "-n", namespace, "link", "set", interface, "up")
                self._ip("ip", "-n", namespace, "link", "set", "lo", "up")
                # a cluster's setting: TCP keeps its window across the pauses between collectives (the
                # default restarts slow start after each idle moment, which a stream of collectives cut by
                # compute would pay again and again, unlike an InfiniBand or RoCE link)
                self._ip("ip", "netns", "exec", namespace, "sysctl", "-q", "-w",
                         "net.ipv4.tcp_slow_start_after_idle=0")
                if self.rate:
                    self._ip("tc", "-n", namespace, "qdisc", "add", "dev", interface, "root",
                             "tbf", "rate", self.rate,
                             "burst", self.burst, "latency", "20ms")
        except LinkSetupError:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for namespace in self.namespaces:  # removing a namespace removes its end of the pair, and the pair
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)

    def command(self, node: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def popen(self, node: int, argv: list[str], env: dict, **kwargs) -> subprocess.Popen:
        """Start ``argv`` in node ``node``'s namespace."""
        return subprocess.Popen(self.command(node, argv), env=env, **kwargs)

    def rank_env(self, rank: int, ranks: int, per_node: int, port: int) -> dict:
        """The environment of global rank ``rank`` of a world of ``ranks``, ``per_node`` consecutive ranks a
        node, its rendezvous on node 0 at ``port``: gloo's traffic to the other node crosses the pair."""
        node = rank // per_node
        return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank % per_node),
                    LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR=self.address(0), MASTER_PORT=str(port),
                    GLOO_SOCKET_IFNAME=self.interface(node), OMP_NUM_THREADS="1", WANDB_MODE="disabled")

    def run_ranks(self, argv: list[str], ranks: int, per_node: int, port: int, directory: str) -> None:
        """Run ``argv`` as every rank of a world on the two nodes (rank R's output in
        ``directory``/rank<R>.log) and wait for all; a failed rank stops the caller with its log's tail."""
        processes = []
        for rank in range(ranks):
            log = open(os.path.join(directory, f"rank{rank}.log"), "w")
            processes.append((self.popen(rank // per_node, argv, self.rank_env(rank, ranks, per_node, port),
                                         stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd()), log))
        failed = []
        for rank, (process, log) in enumerate(processes):
            if process.wait():
                failed.append(rank)
            log.close()
        if failed:
            with open(os.path.join(directory, f"rank{failed[0]}.log")) as handle:
                sys.exit(f"run failed on ranks {failed}: {' '.join(argv)}\n{handle.read()[-3000:]}")

    def sent(self, node: int) -> tuple[int, int]:
        """(bytes, frames) node ``node``'s end of the pair has sent so far."""
        return link_sent(self.interfaces[node], self.namespaces[node])

    def probe(self, source: int, target: int, nbytes: int = 64 << 20,
              port: int = 5599) -> tuple[float, float]:
        """(bytes per second, one-way latency in seconds) of a TCP stream from node ``source`` to node
        ``target`` (the same node: its loopback)."""
        host = self.address(target) if source != target else "127.0.0.1"
        server = self.popen(target,
                            [sys.executable, "-c", PROBE, "server", host, str(port), str(nbytes)], os.environ,
                            stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()  # "ready"
            client = subprocess.run(self.command(source,
                                                 [sys.executable, "-c", PROBE, "client", host, str(port),
                                                          str(nbytes)]),
                                    capture_output=True, text=True, check=True)
        finally:
            server.wait(timeout=60)
        bandwidth, latency = client.stdout.split()
        return float(bandwidth), float(latency)
