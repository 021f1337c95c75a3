"""DistSession's options checked before anything starts: no engine, no controller here."""

from __future__ import annotations

import warnings

import pytest

from nbdist import DistSession
from nbdist.errors import PlacementError


def test_connect_takes_a_cluster_file_and_plans_nothing_until_the_engines_report(tmp_path):
    cluster_file = tmp_path / "cluster-abc.json"
    cluster_file.write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # connect= is the current name: no warning
        s = DistSession(connect=str(cluster_file), cpu=True)
    assert s.options.connect == str(cluster_file)
    assert s.placement is None
    assert not s.running


def test_attach_is_the_deprecated_name_of_connect(tmp_path):
    cluster_file = tmp_path / "cluster-abc.json"
    cluster_file.write_text("{}")
    with pytest.warns(DeprecationWarning, match="connect="):
        s = DistSession(attach=str(cluster_file), cpu=True)
    assert s.options.connect == str(cluster_file)
    assert not s.running


def test_attach_warns_before_the_options_are_checked(tmp_path):
    missing = str(tmp_path / "absent.json")
    with pytest.warns(DeprecationWarning, match="connect="):
        with pytest.raises(PlacementError, match=r"--connect .*absent\.json.*no such file"):
            DistSession(attach=missing)


def test_connect_and_a_different_attach_are_refused(tmp_path):
    with pytest.warns(DeprecationWarning):
        with pytest.raises(TypeError, match="connect= alone"):
            DistSession(connect=str(tmp_path / "a.json"), attach=str(tmp_path / "b.json"))


def test_only_ranks_a_launcher_starts_watch_for_their_controller(tmp_path, monkeypatch):
    monkeypatch.delenv("NBDIST_CONTROLLER_GONE_S", raising=False)
    # The zygote's ranks end with the kernel; a cluster connected to is not nbdist's.
    assert DistSession(2, cpu=True).options.controller_gone_s is None
    cluster_file = tmp_path / "cluster-abc.json"
    cluster_file.write_text("{}")
    assert DistSession(connect=str(cluster_file), cpu=True).options.controller_gone_s is None
    assert DistSession(2, cpu=True, launcher="local").options.controller_gone_s == 30.0
    monkeypatch.setenv("NBDIST_CONTROLLER_GONE_S", "120")
    assert DistSession(2, cpu=True, launcher="local").options.controller_gone_s == 120.0


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf"])
def test_a_bad_controller_wait_is_refused_before_anything_starts(monkeypatch, value):
    monkeypatch.setenv("NBDIST_CONTROLLER_GONE_S", value)
    with pytest.raises(PlacementError, match=f"NBDIST_CONTROLLER_GONE_S={value!r}.*e.g. 60"):
        DistSession(2, cpu=True, launcher="local")
    DistSession(2, cpu=True)  # the zygote's ranks do not read it
