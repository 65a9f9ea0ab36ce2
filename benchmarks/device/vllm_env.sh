# Source on the GPU machine (`run` tool) from the repository root: vLLM 0.26.0 as staged by
# ../shared/scripts/stage-vllm, carried one part a call (.device/v1 ... .device/v4: the parts
# re-split to 36 MiB so that a part and the tree, ~12 MiB, fit in one call), gathered in /tmp/vst
# and unpacked into /tmp/vsite once all are there; atskv from this tree without an install,
# with a dist-info whose entry point vLLM's plugin loader finds.
# vLLM runs with the image's transformers (5.17): the plugin does not import transformers.
mkdir -p /tmp/vst && for part in .device/v*/vllm.tar.xz.part.*; do [ -f "$part" ] && cp --update=none "$part" /tmp/vst/; done
if [ ! -f /tmp/vsite/.done ] && [ "$(ls /tmp/vst | wc -l)" -ge "${VLLM_PARTS:-4}" ]; then
  mkdir -p /tmp/vsite && cat /tmp/vst/vllm.tar.xz.part.* | tar xJ -C /tmp/vsite && touch /tmp/vsite/.done
fi
mkdir -p /tmp/ep/atskv-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: atskv\nVersion: 0.1.0\n' > /tmp/ep/atskv-0.1.0.dist-info/METADATA
printf '[vllm.general_plugins]\natskv = atskv.runtime.vllm:register\n' > /tmp/ep/atskv-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/ep:$PWD:/tmp/vsite PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
