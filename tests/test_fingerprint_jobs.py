"""The fingerprints job and the similarity job on its .fps: SMILES to neighbours with the
molecules' ids, exact against RDKit's BulkTanimotoSimilarity."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dask_gpuchunk.cli import main
from dask_gpuchunk.io.fingerprint_files import read_fpsim2

pytest.importorskip("rdkit")
from rdkit import Chem, DataStructs  # noqa: E402
from rdkit.Chem import rdFingerprintGenerator  # noqa: E402
from test_fingerprint_files import smiles_set  # noqa: E402


def test_smiles_to_neighbours_with_ids_match_rdkit(tmp_path, monkeypatch):
    smiles = smiles_set()
    lines = [f"{s} MOL{i:05d}" for i, s in enumerate(smiles)]
    lines.insert(17, "C1CC(broken MOLBAD")
    (tmp_path / "mols.smi").write_text("# a comment line\n" + "\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    made = CliRunner().invoke(main, ["fingerprints", "mols.smi", "-o", "fps.fps", "--json"])
    assert made.exit_code == 0, made.output
    summary = json.loads(made.output.strip().splitlines()[-1])
    assert summary["unparsed"] == 1 and summary["unparsed_ids"] == ["MOLBAD"]
    assert summary["output"]["shape"] == [len(smiles), 256]
    found = CliRunner().invoke(main, ["similarity", "fps.fps", "--top-k", "5", "--threshold",
                                      "0.3", "--device", "cpu", "-o", "nn.npz"])
    assert found.exit_code == 0, found.output
    generator = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    fps = [generator.GetFingerprint(Chem.MolFromSmiles(s)) for s in smiles]
    with np.load(tmp_path / "nn.npz") as got:
        assert got["ids"].tolist() == [f"MOL{i:05d}" for i in range(len(smiles))]
        for row in range(0, len(smiles), 97):
            want = np.array(DataStructs.BulkTanimotoSimilarity(fps[row], fps), np.float32)
            want[row] = -1  # each molecule's pair with itself is left out
            order = np.argsort(-want.astype(np.float64), kind="stable")[:5]
            meets = want[order] >= np.float32(0.3)
            np.testing.assert_array_equal(got["indices"][row], np.where(meets, order, -1))
            np.testing.assert_array_equal(got["scores"][row],
                                          np.where(meets, want[order], np.nan))


def test_fingerprints_into_a_npy_and_bad_options(tmp_path, monkeypatch):
    (tmp_path / "m.smi").write_text("CCO a\nc1ccccc1 b\n")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["fingerprints", "m.smi", "-o", "w.npy", "--bits", "64",
                                  "--kind", "atompair"])
    assert r.exit_code == 0, r.output
    assert np.load(tmp_path / "w.npy").shape == (2, 8)
    for args, match in [(["-o", "w.txt"], "an .fps file"), (["-o", "w.npy"], "exists"),
                        (["-o", "x.fps", "--bits", "60"], "multiple of 8")]:
        r = CliRunner().invoke(main, ["fingerprints", "m.smi", *args])
        assert r.exit_code != 0 and match in r.output, r.output
    r = CliRunner().invoke(main, ["fingerprints", "none.smi", "-o", "x.fps"])
    assert r.exit_code == 3 and "no such file" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.smi", "w.npy"]


def test_fps_queries_against_an_fpsim2_database(tmp_path, monkeypatch):
    from test_fingerprint_files import _fpsim2_database

    smiles = smiles_set()[::3]
    _fpsim2_database(tmp_path / "db.h5", smiles)
    (tmp_path / "q.smi").write_text("".join(f"{s} Q{i}\n" for i, s in enumerate(smiles[::40])))
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(main, ["fingerprints", "q.smi", "-o", "q.fps"]).exit_code == 0
    r = CliRunner().invoke(main, ["similarity", "db.h5", "--queries", "q.fps", "--top-k", "1",
                                  "--device", "cpu", "-o", "nn.npz"])
    assert r.exit_code == 0, r.output
    with np.load(tmp_path / "nn.npz") as got:
        # each query is in the database: its best is itself, or a molecule of equal bits
        # (the same molecule written another way) with a smaller row in the database
        best = got["indices"][:, 0]
        assert got["query_ids"].tolist() == [f"Q{i}" for i in range(len(smiles[::40]))]
        np.testing.assert_array_equal(got["scores"][:, 0], 1.0)
        db = read_fpsim2(tmp_path / "db.h5")
        rows_of = {int(i): r for r, i in enumerate(db.ids)}
        for q, row in enumerate(best):
            itself = rows_of[q * 40 + 1]
            assert row <= itself and (db.words[row] == db.words[itself]).all()
    r = CliRunner().invoke(main, ["similarity", "db.h5", "--queries", "q.smi", "--top-k", "1",
                                  "-o", "x.npz"])
    assert r.exit_code == 3, r.output
