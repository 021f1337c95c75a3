"""Unit tests for nbdist.engine.netif: the interface gloo/NCCL use on a rank."""

from __future__ import annotations

import pytest

from nbdist.engine.netif import (
    address_towards,
    choose_socket_ifname,
    interface_for,
    local_interfaces,
    socket_ifname_env,
)

TABLE = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["192.168.1.20", "fe80::1%eth0"],
    "ib0": ["10.10.0.7"],
    "docker0": [],
}


@pytest.mark.parametrize(
    "address, expected",
    [
        ("10.10.0.7", "ib0"),
        ("192.168.1.20", "eth0"),
        ("fe80::1", "eth0"),
        ("127.0.0.1", "lo"),
        ("127.0.1.1", "lo"),  # Debian's hostname address: still loopback
        ("10.10.0.8", None),
        ("not-an-address", None),
    ],
)
def test_interface_holding_an_address(address, expected):
    assert interface_for(address, TABLE) == expected


def test_both_backends_get_the_interface():
    assert socket_ifname_env("10.10.0.7", TABLE, environ={}) == {
        "GLOO_SOCKET_IFNAME": "ib0",
        "NCCL_SOCKET_IFNAME": "ib0",
    }


def test_the_users_setting_wins_per_variable():
    env = {"NCCL_SOCKET_IFNAME": "ib1"}
    assert socket_ifname_env("10.10.0.7", TABLE, environ=env) == {"GLOO_SOCKET_IFNAME": "ib0"}
    env = {"NCCL_SOCKET_IFNAME": "ib1", "GLOO_SOCKET_IFNAME": "eth0"}
    assert socket_ifname_env("10.10.0.7", TABLE, environ=env) == {}


def test_an_empty_user_value_counts_as_unset():
    assert socket_ifname_env("10.10.0.7", TABLE, environ={"GLOO_SOCKET_IFNAME": ""}) == {
        "GLOO_SOCKET_IFNAME": "ib0",
        "NCCL_SOCKET_IFNAME": "ib0",
    }


def test_no_interface_holds_the_address_leaves_the_backends_choice():
    assert socket_ifname_env("172.16.0.1", TABLE, environ={}) == {}


def test_loopback_without_an_explicit_entry_finds_the_lo_interface():
    assert interface_for("127.0.0.1", {"lo0": [], "en0": ["10.0.0.1"]}) == "lo0"


def test_this_machine_loopback_route_and_interface():
    # Real interface table: loopback is always there, and a loopback master means 'lo'.
    table = local_interfaces()
    assert interface_for("127.0.0.1", table) is not None
    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert address_towards("localhost") == "127.0.0.1"
    env: dict[str, str] = {}
    chosen = choose_socket_ifname("127.0.0.1", env)
    assert chosen == env
    assert env["GLOO_SOCKET_IFNAME"] == interface_for("127.0.0.1", table)


def test_choose_keeps_what_the_user_set():
    env = {"GLOO_SOCKET_IFNAME": "mine", "NCCL_SOCKET_IFNAME": "mine"}
    assert choose_socket_ifname("127.0.0.1", env) == {}
    assert env == {"GLOO_SOCKET_IFNAME": "mine", "NCCL_SOCKET_IFNAME": "mine"}
