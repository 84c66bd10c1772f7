#!/usr/bin/env bash
# Build and install mmcv 2.1.0 with its compiled ops into the active Python environment.
#
# MMDetection 3.3 needs mmcv>=2.0,<2.2 with compiled ops (RoIAlign, NMS), and OpenMMLab publishes no
# wheel of it for recent torch. This script builds it from the source package, which needs three
# changes to build against torch>=2.9:
#   - an older setuptools (<70: mmcv's setup.py imports pkg_resources) installed to a private folder,
#     so the environment's own setuptools stays as it is;
#   - no build isolation, so the build compiles against the environment's torch;
#   - C++20 instead of the hard-coded C++14/C++17 (torch's headers need C++20).
# The wheel is cached (MMCV_WHEEL_DIR, default ~/.cache/cd-mmcv/<torch version>), so a second run on
# the same torch installs in seconds. mmcv-lite, the pure-Python package, is removed first: both
# provide the `mmcv` module.
#
#   bash scripts/install_mmcv.sh          # CPU ops; 9-14 min on 2 Intel cores, ~36 on 2 slower AMD ones (docs/measurements.md)
#   FORCE_CUDA=1 bash scripts/install_mmcv.sh   # CUDA ops too (needs nvcc)
set -euo pipefail

MMCV_VERSION=2.1.0
python -c "import torch" 2>/dev/null || { echo "error: torch is not importable by 'python'; activate the environment that has torch, then run this again" >&2; exit 2; }
torch_version=$(python -c "import torch; print(torch.__version__.split('+')[0])")
wheel_dir=${MMCV_WHEEL_DIR:-$HOME/.cache/cd-mmcv/torch-$torch_version-${FORCE_CUDA:-0}}
mkdir -p "$wheel_dir"

wheel=$(ls "$wheel_dir"/mmcv-$MMCV_VERSION-*.whl 2>/dev/null | head -1 || true)
if [[ -z "$wheel" ]]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "building mmcv $MMCV_VERSION against torch $torch_version in $work"
    python -m pip install --quiet --target "$work/tools" "setuptools<70" wheel ninja
    export PYTHONPATH="$work/tools${PYTHONPATH:+:$PYTHONPATH}" PATH="$work/tools/bin:$PATH"
    python -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
        -d "$work" "mmcv==$MMCV_VERSION"
    tar -xzf "$work/mmcv-$MMCV_VERSION.tar.gz" -C "$work"
    # torch>=2.9 headers are C++20; mmcv 2.1.0 hard-codes -std=c++14 / c++17 in setup.py.
    sed -i -E "s/-std=c\+\+1[47]/-std=c++20/g" "$work/mmcv-$MMCV_VERSION/setup.py"
    MMCV_WITH_OPS=1 FORCE_CUDA=${FORCE_CUDA:-0} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
        python -m pip wheel --no-deps --no-build-isolation -w "$wheel_dir" "$work/mmcv-$MMCV_VERSION"
    wheel=$(ls "$wheel_dir"/mmcv-$MMCV_VERSION-*.whl | head -1)
fi

if python -m pip show --quiet mmcv-lite 2>/dev/null; then
    python -m pip uninstall --quiet -y mmcv-lite
fi
python -m pip install --quiet --no-deps --force-reinstall "$wheel"
python -c "from mmcv.ops import nms, RoIAlign; import mmcv; print(f'mmcv {mmcv.__version__} with compiled ops: ok')"
