"""The emulated slow link: two network namespaces whose veth pair carries what tc allows, while each
namespace's loopback stays fast; made and removed by the context manager."""

import subprocess

import pytest

from launch.bench.netns_link import LinkSetupError, TwoNodes


def test_the_shaped_pair_carries_its_rate_and_is_removed_after():
    try:
        nodes = TwoNodes(rate="100mbit")
        nodes.__enter__()
    except LinkSetupError as error:  # not root, or no iproute2 (e.g. an unprivileged container)
        pytest.skip(str(error))
    try:
        across, latency = nodes.probe(0, 1, nbytes=4 << 20)
        loopback, _ = nodes.probe(1, 1, nbytes=4 << 20)
    finally:
        nodes.__exit__(None, None, None)
    assert across == pytest.approx(100e6 / 8, rel=0.25), across * 8 / 1e6  # Mbit/s
    assert loopback > 10 * across and 0 < latency < 0.05
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(namespace in listed for namespace in nodes.namespaces)
