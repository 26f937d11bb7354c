"""Settings set from Python are checked where the API reads them, as the command line checks
them: the error names the setting, its environment variable and what it takes."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest

import dask_gpuchunk as dg
from dask_gpuchunk import config


@pytest.mark.parametrize("value", ["banana", -3, "1.5"])
def test_a_bad_value_set_from_python_is_named_where_the_api_reads_it(tmp_path, value):
    x = da.from_array(np.arange(12.0).reshape(4, 3), chunks=2)
    with dask.config.set({"gpuchunk.file-writes": value}), pytest.raises(
            ValueError, match=r"^setting gpuchunk\.file-writes \(environment: "
                              r"DASK_GPUCHUNK__FILE_WRITES\) is .*; it takes a whole number"):
        dg.to_npy(x, tmp_path / "x.npy")
    assert not list(tmp_path.iterdir())


def test_a_flag_given_as_text_is_read_as_its_words():
    with dask.config.set({"gpuchunk.resolve-aliases": "False"}):
        assert config.flag("resolve-aliases") is False
    with dask.config.set({"gpuchunk.resolve-aliases": "maybe"}), pytest.raises(
            ValueError, match="gpuchunk.resolve-aliases .* True or False"):
        config.flag("resolve-aliases")


def test_at_most_eight_settings_and_the_tuned_choices_apart():
    assert len(config.DEFAULTS) <= 8
    assert set(config.INTERNAL).isdisjoint(config.DEFAULTS)
    assert not any(name in dask.config.get("gpuchunk") for name in config.INTERNAL)


def test_a_tuned_choice_still_given_is_honoured_with_a_warning_and_checked():
    assert config.flag("direct-launch") is True
    with dask.config.set({"gpuchunk.direct-launch": "False"}), \
            pytest.warns(FutureWarning, match="direct-launch .*no longer a setting"):
        assert config.flag("direct-launch") is False
    with dask.config.set({"gpuchunk.read_ahead": False}), \
            pytest.warns(FutureWarning, match="read-ahead"):
        config.check_settings()  # known, not refused
    with dask.config.set({"gpuchunk.direct-launch": "maybe"}), pytest.raises(
            ValueError, match="gpuchunk.direct-launch .* True or False"), \
            pytest.warns(FutureWarning):
        config.flag("direct-launch")
    with config.internal_values({"direct-launch": False}):
        assert config.flag("direct-launch") is False  # no warning: the tests' way
    with pytest.raises(KeyError, match="no tuned choice"):
        with config.internal_values({"file-writes": 2}):
            pass


def test_an_unknown_setting_is_named_with_the_closest_one(monkeypatch):
    with dask.config.set({"gpuchunk.file-writs": 2}), pytest.raises(
            ValueError, match=r"no setting gpuchunk\.file-writs .*did you mean "
                              r"gpuchunk\.file-writes\?"):
        config.check_settings()
    # an environment variable's name reaches dask with underscores: still known
    with dask.config.set({"gpuchunk.file_writes": 2}):
        config.check_settings()
        assert config.get("file-writes") == 2


def test_a_removed_setting_warns_why_and_does_nothing():
    assert set(config.REMOVED).isdisjoint(config.DEFAULTS)
    with dask.config.set({"gpuchunk.share-reads": False}), \
            pytest.warns(FutureWarning, match=r"gpuchunk\.share-reads .*removed.*UCX"):
        config.check_settings()
    with dask.config.set({"gpuchunk.share_device_chunks": True}), \
            pytest.warns(FutureWarning, match="share-device-chunks"):
        config.check_settings()
