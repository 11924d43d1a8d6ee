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


def test_the_bytes_counted_as_leaving_a_node_are_those_on_its_link():
    """Every collective of parallel.comm alone, four ranks on two emulated nodes: the TCP payload node 0's
    end of the link sent (its veth statistics less the frame headers) is what its ranks counted as
    crossing, within 5% (gloo's own message framing)."""
    from launch.bench.wire_bytes import measure

    try:
        nodes = TwoNodes()
        nodes.__enter__()
    except LinkSetupError as error:
        pytest.skip(str(error))
    try:
        rows = measure(nodes, 1 << 18)  # 1 MiB of fp32 a rank
    finally:
        nodes.__exit__(None, None, None)
    assert {row["operation"] for row in rows} >= {"all_reduce", "reduce_scatter", "all_gather", "all_to_all",
                                                   "broadcast", "p2p", "all_gather (qwZ)", "all_to_all (qgZ)"}
    for row in rows:
        assert row["counted"] > 0 and row["payload"] == pytest.approx(row["counted"], rel=0.05), row
