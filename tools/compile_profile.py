"""What a first similarity job compiles, and for how long (run on a GPU machine whose CuPy
kernel cache is empty: a fresh one, or ``CUPY_CACHE_DIR`` set to a new folder).

    python3 tools/compile_profile.py --rows 1000000 --out $OUT/compile.json

Writes ``--rows`` random packed 2048-bit fingerprints (7.5 % density) to a ``.npy``, then runs
the similarity job (top-10, in this process, as the command does by default on one GPU) with
every NVRTC compile CuPy makes timed (its compile function in ``cupy.cuda.compiler`` wrapped): its
kernels' names, source size, options, seconds, the thread and when it started. Then the job
again (warm), and a threshold job (what it adds). Last, the compiles of over half a second are
made again, one after the other and then all at once in threads, to see whether NVRTC runs
them side by side (CuPy calls it without the GIL).
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import cupy.cuda.compiler as compiler

T0 = time.perf_counter()
_log: list[dict[str, Any]] = []
_calls: list[tuple[tuple, dict]] = []
# CuPy 14 compiles through a private function (``compile_using_nvrtc`` warns and calls it).
_ENTRY = ("_compile_using_nvrtc_no_warning" if hasattr(compiler, "_compile_using_nvrtc_no_warning")
          else "compile_using_nvrtc")
_nvrtc = getattr(compiler, _ENTRY)


def _timed_nvrtc(source: str, *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    result = _nvrtc(source, *args, **kwargs)
    seconds = time.perf_counter() - start
    _log.append({"kernels": re.findall(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s+)?"
                                       r"(?:void\s+)?(\w+)\s*\(", source)[:8],
                 "chars": len(source), "options": [str(o) for o in (args[0] if args else ())],
                 "seconds": round(seconds, 3), "start": round(start - T0, 3),
                 "thread": threading.current_thread().name,
                 "binary_bytes": len(result[0]) if isinstance(result, tuple) else None,
                 # where in the package (or a tool) the compile was asked for
                 "called_from": [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                                 for f in traceback.extract_stack()[:-1]
                                 if "dask_gpuchunk" in f.filename or "tools" in f.filename
                                 ][-4:]})
    _calls.append(((source, *args), kwargs))
    return result


setattr(compiler, _ENTRY, _timed_nvrtc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/compile-profile"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import numpy as np

    from dask_gpuchunk.bench.similarity import make_fingerprints
    from dask_gpuchunk.jobs import similarity_job

    args.work.mkdir(parents=True, exist_ok=True)
    fps = args.work / "fps.npy"
    np.save(fps, make_fingerprints(args.rows, 2048, 0.075, on_gpu=True))
    out: dict[str, Any] = {"rows": args.rows, "setup_s": round(time.perf_counter() - T0, 3)}
    for label, select in [("top-10 cold", {"top_k": 10}), ("top-10 warm", {"top_k": 10}),
                          ("threshold 0.7", {"threshold": 0.7})]:
        before = len(_log)
        t0 = time.perf_counter()
        result = similarity_job(fps, args.work / "out.npz", packed=True, overwrite=True,
                                **select)(None)
        out[label] = {"job_s": round(result["seconds"], 3),
                      "wall_s": round(time.perf_counter() - t0, 3),
                      "compiles": _log[before:]}
        print(label, out[label]["job_s"], out[label]["wall_s"], len(_log) - before,
              "compiles", round(sum(c["seconds"] for c in _log[before:]), 2), "s", flush=True)
    big = [call for call, entry in zip(_calls, _log) if entry["seconds"] > 0.5]
    t0 = time.perf_counter()
    for (a, k) in big:
        _nvrtc(*a, **k)
    out["big compiles one by one_s"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(len(big), 1)) as pool:
        list(pool.map(lambda call: _nvrtc(*call[0], **call[1]), big))
    out["big compiles in threads_s"] = round(time.perf_counter() - t0, 3)
    print({k: v for k, v in out.items() if k.startswith("big")}, len(big), flush=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
