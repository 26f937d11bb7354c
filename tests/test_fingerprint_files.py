"""Fingerprints in chemists' forms (dask_gpuchunk.io.fingerprint_files): FPS files, SMILES through
RDKit, lists of RDKit bit vectors, against RDKit's own fingerprints and similarities."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_bits

import dask_gpuchunk as dg
from dask_gpuchunk import _compat
from dask_gpuchunk.io import fingerprint_files as ff

rdkit = pytest.importorskip("rdkit")
from rdkit import Chem, DataStructs  # noqa: E402
from rdkit.Chem import rdFingerprintGenerator  # noqa: E402

#: Substituents and scaffolds of drug-like-looking molecules: 3 positions' worth of
#: combinations, a few thousand distinct SMILES.
GROUPS = ["", "C", "CC", "O", "N", "F", "Cl", "Br", "C(=O)O", "C#N", "OC", "N(C)C", "C(F)(F)F",
          "S", "C=O", "CCO", "c2ccccc2", "[N+](=O)[O-]", "C(=O)N", "CC(C)C"]
SCAFFOLDS = ["c1{a}ccc{b}cc1", "c1{a}ccnc{b}c1", "C1{a}CCN{b}CC1", "c1{a}ccc{b}s1",
             "O=C(N{b})c1cc{a}ccc1", "c1{a}cc(C(=O)N{b})cc1"]


def smiles_set() -> list[str]:
    """2,000 SMILES RDKit parses, some of one molecule written two ways."""
    from rdkit import RDLogger

    def group(r: str) -> str:
        return f"({r})" if r else ""

    out = [s.format(a=group(a), b=group(b)) for s in SCAFFOLDS for a in GROUPS for b in GROUPS]
    RDLogger.DisableLog("rdApp.*")
    try:
        return [s for s in out if Chem.MolFromSmiles(s) is not None]
    finally:
        RDLogger.EnableLog("rdApp.*")


def test_the_smiles_set_is_large_and_parses():
    assert len(smiles_set()) >= 2000


def test_fps_round_trip_keeps_words_ids_and_odd_widths(rng, tmp_path):
    words = np.packbits(random_bits(rng, (37, 20), 0.3), axis=1, bitorder="little")
    ids = np.array([f"CHEMBL{i}" for i in range(37)])
    ff.write_fps(tmp_path / "a.fps", ff.Fingerprints(words, ids, 20))
    back = ff.read_fps(tmp_path / "a.fps")
    np.testing.assert_array_equal(back.words, words)
    assert back.ids.tolist() == ids.tolist() and back.num_bits == 20
    with pytest.raises(FileExistsError):
        ff.write_fps(tmp_path / "a.fps", back)


@pytest.mark.parametrize("text, match", [
    ("hello\n", "not an FPS file"),
    ("#FPS1\n#num_bits=16\n00ff\tm1\n0g00\tm2\n", "line 4: not hex"),
    ("#FPS1\n00ff\tm1\n00ff00\tm2\n", "line 3: expected 4 hex digits"),
    ("#FPS1\n#num_bits=32\n00ff\tm1\n", "num_bits=32 but line 3 holds 16"),
    ("#FPS1\n00ff\n", "line 2: expected HEX<tab>ID"),
])
def test_a_damaged_fps_file_is_refused_by_its_line(tmp_path, text, match):
    (tmp_path / "bad.fps").write_text(text)
    with pytest.raises(ff.FpsError, match=match):
        ff.read_fps(tmp_path / "bad.fps")


def test_smiles_fingerprints_are_rdkits_bit_for_bit():
    smiles = smiles_set()[::7] + ["not a molecule"]
    words, parsed = ff.smiles_fingerprints(smiles, bits=1024, radius=3, processes=1)
    generator = rdFingerprintGenerator.GetMorganGenerator(radius=3, fpSize=1024)
    want = np.stack([generator.GetFingerprintAsNumPy(Chem.MolFromSmiles(s))
                     for s in smiles[:-1]])
    np.testing.assert_array_equal(np.unpackbits(words[:-1], axis=1, bitorder="little"), want)
    assert parsed[:-1].all() and not parsed[-1] and not words[-1].any()


@pytest.mark.slow
def test_smiles_fingerprints_in_processes_equal_those_in_one(monkeypatch):
    monkeypatch.setattr(ff, "_MOLECULES_PER_CALL", 500)
    smiles = smiles_set()[:1500] + ["C1CC"]
    done = []
    words, parsed = ff.smiles_fingerprints(smiles, kind="rdkit", processes=2,
                                           progress=lambda d, t: done.append((d, t)))
    one_words, one_parsed = ff.smiles_fingerprints(smiles, kind="rdkit", processes=1)
    np.testing.assert_array_equal(words, one_words)
    np.testing.assert_array_equal(parsed, one_parsed)
    assert not parsed[-1] and done[-1] == (1501, 1501) and len(done) == 4


def test_lists_of_bit_vectors_score_as_rdkit_scores_them():
    generator = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    fps = [generator.GetFingerprint(Chem.MolFromSmiles(s)) for s in smiles_set()[::11]]
    queries = fps[:9]
    got = dg.similarity(queries, fps).compute()
    want = np.array([DataStructs.BulkTanimotoSimilarity(q, fps) for q in queries], np.float32)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="both as lists of RDKit bit vectors"):
        dg.similarity(queries, np.zeros((3, 2048), np.uint8))
    with pytest.raises(ValueError, match="different widths"):
        ff.bit_vector_words([fps[0], DataStructs.ExplicitBitVect(64)])


def _fpsim2_database(path, smiles: list[str]) -> None:
    """An FPSim2 database of ``smiles`` (Morgan radius 2, 2048 bits), ids 1, 2, ..."""
    pytest.importorskip("FPSim2")
    from FPSim2.io import create_db_file

    create_db_file([[s, i + 1] for i, s in enumerate(smiles)], str(path), mol_format="smiles",
                   fp_type="Morgan", fp_params={"radius": 2, "fpSize": 2048})


def test_an_fpsim2_database_reads_as_rdkits_fingerprints_with_its_ids(tmp_path):
    smiles = smiles_set()[::5]
    _fpsim2_database(tmp_path / "db.h5", smiles)
    db = ff.read_fpsim2(tmp_path / "db.h5")
    words, _ = ff.smiles_fingerprints(smiles, processes=1)
    assert db.num_bits == 2048 and sorted(db.ids.tolist()) == list(range(1, len(smiles) + 1))
    assert db.ids.tolist() != sorted(db.ids.tolist())  # FPSim2 sorts its rows by popcount
    np.testing.assert_array_equal(db.words, words[db.ids - 1])
    (tmp_path / "not.h5").write_bytes(b"\x89HDF\r\n\x1a\nnot really")
    with pytest.raises(ff.FpsError, match="not an FPSim2 database"):
        ff.read_fpsim2(tmp_path / "not.h5")


def test_the_k_best_above_a_threshold_agree_with_fpsim2s_cpu_engine(tmp_path):
    # FPSim2's top_k(query, k, threshold) and similarity(query, threshold), as chemists run
    # them, against dg.similarity of the same database's words.
    smiles = smiles_set()
    _fpsim2_database(tmp_path / "db.h5", smiles)
    from FPSim2 import FPSim2Engine

    engine = FPSim2Engine(str(tmp_path / "db.h5"))
    db = ff.read_fpsim2(tmp_path / "db.h5")
    queries = smiles[::250]
    words, _ = ff.smiles_fingerprints(queries, processes=1)
    indices, scores = (a.compute() for a in dg.similarity(words, db.words, packed=True,
                                                           top_k=8, threshold=0.35))
    planning = _compat.is_array_expression(dg.asarray(words))  # threshold alone refused
    pair_scores = [] if planning else dg.similarity(words, db.words, packed=True,
                                                    threshold=0.35).compute().scores
    assert 0 < (indices >= 0).sum() < indices.size
    found = 0
    for q, query in enumerate(queries):
        theirs = engine.top_k(query, 8, 0.35)
        ours = [(int(db.ids[i]), float(s)) for i, s in zip(indices[q], scores[q]) if i >= 0]
        # the same scores best first; the same molecules where a score is not tied at the end
        np.testing.assert_allclose([s for _, s in ours], theirs["coeff"], rtol=1e-6)
        last = theirs["coeff"][-1] if len(theirs) else None
        assert ({i for i, s in ours if s != last}
                == {int(m) for m, c in zip(theirs["mol_id"], theirs["coeff"]) if c != last})
        found += len(engine.similarity(query, 0.35))
    assert planning or found == len(pair_scores)


def test_fpsim2_databases_we_write_are_read_back_and_searched_by_fpsim2(rng, tmp_path):
    pytest.importorskip("FPSim2")
    from FPSim2 import FPSim2Engine

    words = np.packbits(random_bits(rng, (300, 2048), 0.08), axis=1, bitorder="little")
    ids = np.arange(1000, 1300)
    ff.write_fpsim2(tmp_path / "db.h5", ff.Fingerprints(words, ids, 2048))
    back = ff.read_fpsim2(tmp_path / "db.h5")
    order = np.argsort(back.ids)
    np.testing.assert_array_equal(back.ids[order], ids)
    np.testing.assert_array_equal(back.words[order], words)
    query = DataStructs.ExplicitBitVect(2048)
    query.SetBitsFromList(np.flatnonzero(np.unpackbits(words[7], bitorder="little")).tolist())
    theirs = FPSim2Engine(str(tmp_path / "db.h5")).top_k(query, 5, 0.0)
    ours = dg.similarity(words[7:8], words, packed=True, top_k=5).compute()
    np.testing.assert_allclose(theirs["coeff"], ours.scores[0], rtol=1e-6)
    assert theirs["mol_id"][0] == 1007 and ours.indices[0, 0] == 7


def test_the_gram_of_a_list_of_bit_vectors_counts_their_shared_bits():
    generator = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=1024)
    mols = [Chem.MolFromSmiles(s) for s in smiles_set()[::97]]
    bits = np.stack([generator.GetFingerprintAsNumPy(m) for m in mols]).astype(np.float64)
    got = dg.gram([generator.GetFingerprint(m) for m in mols]).compute()
    np.testing.assert_array_equal(got, bits @ bits.T)
