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
    with dask.config.set({"gpuchunk.direct-launch": "False"}):
        assert config.flag("direct-launch") is False
    with dask.config.set({"gpuchunk.direct-launch": "maybe"}), pytest.raises(
            ValueError, match="gpuchunk.direct-launch .* True or False"):
        config.flag("direct-launch")


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
