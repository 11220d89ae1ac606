"""``python -m manygpu.emulate``'s parser and the names its hosts resolve (no namespaces)."""

from __future__ import annotations

from manygpu.emulate.__main__ import build_parser
from manygpu.emulate.netns import hosts_file


def test_help_keeps_the_example_block_and_explains_every_option() -> None:
    text = build_parser().format_help()
    assert "::" not in text and "``" not in text
    # The example keeps its two lines, the continuation indented as written.
    assert (
        "e.g.\n\n    sudo python -m manygpu.emulate --hosts 2 -- manygpu launch --nnodes 2 \\\n"
        "        --node-rank {host} --master-addr {master} --nproc-per-node 1 train.py\n"
    ) in text
    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings or action.dest} has no help"


def test_every_host_address_has_a_name_both_ways() -> None:
    """A peer seen by a dual-stack listener as ::ffff:10.213.0.2 must resolve from the
    hosts file, or the TCPStore's reverse lookup goes to a DNS server the namespaces
    cannot reach (and torch warns once per connection)."""
    text = hosts_file(
        "127.0.0.1 localhost\n", ["h-0", "h-1"], ["10.213.0.1", "10.213.0.2"], {"pod-0.svc": 0}
    )
    lines = text.splitlines()
    assert lines[0] == "127.0.0.1 localhost"
    for addr, name in (("10.213.0.1", "h-0"), ("10.213.0.2", "h-1")):
        assert f"{addr} {name}" in lines and f"::ffff:{addr} {name}" in lines
    assert "10.213.0.1 pod-0.svc" in lines and "::ffff:10.213.0.1 pod-0.svc" in lines
    # The cluster's name comes first, so it is what a reverse lookup answers (a verdict
    # names a lost peer "node1", not the namespace).
    assert lines.index("10.213.0.1 pod-0.svc") < lines.index("10.213.0.1 h-0")
