# Sourced by tools/gpu-records.sh on the GPU machine: Ray from .devwheels (when
# carried), PYTHONPATH, the GPU's name in $OUT/gpu.txt, and `step NAME LIMIT CMD...`,
# which runs CMD with a time limit, its output in $OUT/NAME.log, and prints its tail.
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -d .devwheels ]; then
  mkdir -p .site && tar -xJf .devwheels/ray-cp312.tar.xz -C .site \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target .site .devwheels/*.whl 2>/dev/null \
    && chmod -R +x .site/ray/core
fi
export PYTHONPATH=$PWD/.site:$PWD RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=60
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
step() { local name=$1 limit=$2; shift 2; echo "== $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1;
         echo "   rc=$? after ${SECONDS}s"; tail -12 "$OUT/$name.log"; }
