# On the device (second call, repo root): setup, then the CUDA tests and bench snapshot on cuda.
# About 5 minutes on an H100 (stop 35: setup 21 s, tests 134 s, bench 43 s, resume 107 s).
set -u
T0=$SECONDS
bash .dev/setup.sh > "$OUT/setup.log" 2>&1; echo "setup rc=$? s=$((SECONDS - T0))"; tail -3 "$OUT/setup.log"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
# cnr.models and cnr.readers are top-level folders that pyproject's package-dir maps into cnr; the
# tree here is not installed, so map them by links (this copy of the tree is thrown away)
for d in models readers; do [ -e cnr/$d ] || ln -s ../$d cnr/$d; done
# `cnr train` subprocesses of the tests set PYTHONPATH to the repo alone: give them /tmp/site too
echo /tmp/site > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/cnr-device.pth"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
step() { local n=$1 t=$2; shift 2; local a=$SECONDS; timeout -k 5 "$t" "$@" > "$OUT/$n.log" 2>&1; echo "$n rc=$? s=$((SECONDS - a))"; tail -3 "$OUT/$n.log"; }
step cuda_tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -rs -k "not cpu" --durations=8
step bench_cuda 120 python3 -m cnr bench snapshot --device cuda --repeats 3 --scales ''
step ws1_resume 240 python3 -m pytest -q -p no:cacheprovider tests/test_train_resume.py::test_resume_is_bit_exact_world_size_1
echo "total s=$((SECONDS - T0))"
