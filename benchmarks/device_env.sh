# Sourced by the device scripts (run from the repository root on the lent GPU): names the GPU, makes the
# top-level patches/ importable as psr_hf.patches from the source tree, and puts the tree on PYTHONPATH.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import psr_hf.patches" 2>/dev/null || ln -sfn ../patches psr_hf/patches
export PYTHONPATH=$PWD

# left: the seconds of the call's TOTAL_S (default 570) not yet spent since the script set START=$SECONDS;
# cap N: N, or what is left if that is less (a part's timeout)
left() { echo $(( ${TOTAL_S:-570} - (SECONDS - START) )); }
cap() { local l; l=$(left); [ "$l" -gt "$1" ] && echo "$1" || echo "$l"; }

# unxz_copy SRC DEST: DEST holds SRC's files, those compressed with xz decompressed (a carry is at most 64 MiB, so
# shards and built models travel compressed)
unxz_copy() {
    mkdir -p "$2"
    python3 -c "import lzma, pathlib, shutil, sys
for p in pathlib.Path(sys.argv[1]).iterdir():
    if p.is_file():
        dst = pathlib.Path(sys.argv[2]) / (p.stem if p.suffix == '.xz' else p.name)
        with (lzma.open(p) if p.suffix == '.xz' else open(p, 'rb')) as src, open(dst, 'wb') as out:
            shutil.copyfileobj(src, out)
    elif p.is_dir():
        shutil.copytree(p, pathlib.Path(sys.argv[2]) / p.name, dirs_exist_ok=True)" "$1" "$2"
}

# cuda_suite SECONDS: `pytest -m cuda` over every test file that has a cuda test, on WORKERS (default 8) pytest-xdist
# workers sharing the GPU, for at most SECONDS of the call; failures with their short tracebacks in
# $OUT/cuda_tests.txt, its exit status and last lines in $LOG
cuda_suite() {
    echo "== cuda tests" | tee -a "$LOG"
    timeout "$(cap "$1")" python3 -m pytest -m cuda -q -p no:cacheprovider -n "${WORKERS:-8}" --dist worksteal \
        --tb=short -rfE --durations=15 $(grep -l "mark.cuda" tests/test_*.py) > "$OUT/cuda_tests.txt" 2>&1
    echo "pytest exit $?" | tee -a "$LOG"
    tail -25 "$OUT/cuda_tests.txt" | tee -a "$LOG"
}
