# Source on the GPU machine (`run` tool) from the repository root: installs the carried wheels
# (.whl/: transformers 5.24 and friends; the image has 5.17) once per machine, unpacks
# the carried corpora, and points ATSKV_CACHE there.
# What `benchmarks/device/stage.sh` staged travels in `carry`: model GGUFs in parts (.device/s1,
# .device/g1, ...: one part a call) are gathered in /tmp/mdl and joined by `assemble`; kvpress's
# wheels (.device/kvw) become /tmp/kvpy/python, its own environment; a HEAD snapshot
# (.device/head.tar) becomes /tmp/head, a tree for background jobs that no later call rewrites.
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl $(ls .device/wh/*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD ATSKV_CACHE=/tmp/atskv-cache
# (a failed fetch leaves the folder empty: unpack unless a corpus text is there)
if [ -f .device/corpora.tar.xz ] && [ -z "$(find "$ATSKV_CACHE/corpora" -name '*.txt' -print -quit 2>/dev/null)" ]; then
  mkdir -p "$ATSKV_CACHE" && tar xJf .device/corpora.tar.xz -C "$ATSKV_CACHE"
fi
if [ -d .device/kvw ] && [ ! -d /tmp/kvsite ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvsite .device/kvw/*.whl
  mkdir -p /tmp/kvpy && printf '#!/bin/bash\nexport PYTHONPATH=/tmp/kvsite\nexec python3 "$@"\n' > /tmp/kvpy/python
  chmod +x /tmp/kvpy/python
fi
if [ -f .device/head.tar ] && [ ! -d /tmp/head ]; then
  mkdir -p /tmp/head && tar xf .device/head.tar -C /tmp/head
fi
mkdir -p /tmp/mdl && for part in .device/*.part.* .device/*/*.part.*; do [ -f "$part" ] && cp "$part" /tmp/mdl/; done
assemble() {  # assemble NAME: /tmp/mdl/NAME from its parts
  [ -f "/tmp/mdl/$1" ] || { cat "/tmp/mdl/$1".part.* > "/tmp/mdl/$1" && rm "/tmp/mdl/$1".part.*; }
}
