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
