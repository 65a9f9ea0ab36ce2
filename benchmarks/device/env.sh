# Source on the GPU machine (`run` tool) from the repository root: installs the carried wheels
# (.whl/: transformers 5.23 and friends; the image has 5.17) once per machine, maps `kernels/` to
# `atskv.kernels` without an install, unpacks the carried corpora, and points ATSKV_CACHE there.
# Model GGUFs travel in parts under .device/ (`split -b 40M -d FILE FILE.part.`) and are
# gathered in /tmp/mdl by `assemble`.
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD ATSKV_CACHE=/tmp/atskv-cache
ln -sfn ../kernels atskv/kernels
if [ -f .device/corpora.tar.xz ] && [ ! -d "$ATSKV_CACHE/corpora" ]; then
  mkdir -p "$ATSKV_CACHE" && tar xJf .device/corpora.tar.xz -C "$ATSKV_CACHE"
fi
mkdir -p /tmp/mdl && for part in .device/*.part.*; do [ -f "$part" ] && cp "$part" /tmp/mdl/; done
assemble() {  # assemble NAME: /tmp/mdl/NAME from its parts
  [ -f "/tmp/mdl/$1" ] || cat "/tmp/mdl/$1".part.* > "/tmp/mdl/$1"
}
