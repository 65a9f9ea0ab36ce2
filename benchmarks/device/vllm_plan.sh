# The vLLM plugin's GPU plan, one stage a call (each well under the 10-minute limit), after the
# four staging calls of vllm_env.sh (send every call in ONE message: a pause loses the machine):
#   bash benchmarks/device/vllm_plan.sh profile   # per-stage kernel times (~40 s, no vLLM needed)
#   bash benchmarks/device/vllm_plan.sh kernels   # no vLLM needed (.device/pt carried): the kernel tests compiled
#        (not the fast path's: they need atskv's transformers, .whl, which does not fit beside .device/v1),
#        one prefill chunk's prompt scoring part by part, then the mass and predictor kernels' tiles swept
#        and the list's top-k against a sort, at 32K (~7 min; SparQ's pick: `profile`)
#   bash benchmarks/device/vllm_plan.sh decode [METHODS]  # vanilla vLLM, Quest, StreamingLLM (or LABEL=vllm:X ...): 3 shapes (~7.5 min;
#        RUNS='32768x8' for fewer; DENSE='{"LABEL": 0}' for other dense layers than 2; OPTIONS='{"LABEL":
#        {"prompt_sample": 8}}' for a selector's options; PROFILE=1: each batch's last 8 full-batch steps
#        profiled, vLLM's CUDA-time table per label and shape; PROFILE_PREFILL=1: each batch's prefill too, again
#        after its row; FREE="h0 ht": labels that free blocks; HOST_TIER='{"ht": {"regions": 8}}': labels with the
#        plugin's host tier, e.g. h0=vllm:h2o ht=vllm:h2o to time the tier beside compaction alone)
#   bash benchmarks/device/vllm_plan.sh tests [K] # the plugin's GPU tests, small engines of ~40 s each: run
#        'not rank_tokens and not preempted and not refresh' (~4 min), 'rank_tokens' (~7.5 min) and
#        'preempted or refresh' (~6 min) as three calls (one would pass the 10-minute limit)
#   bash benchmarks/device/vllm_plan.sh trace METHODS [free [NEW]]  # Poisson traces of 16K-128K prompts at
#        0.25 and 1 request/s through one engine a method ("vllm vllm:streaming_llm" quoted: both, one after the
#        other, rows in one file), NEW tokens each (256; ~7 min; free: unread blocks back, vanilla's unaffected);
#        RATES='2.0' LIMIT=240 REQUESTS=32 DENSE=0 for other rates, cut-off (s), request counts and dense layers;
#        OPTIONS as inflight's; ENGINE='{"max_num_batched_tokens": 2048}' for vLLM's own settings (a smaller prefill
#        chunk: decode steps beside it wait less); HOST_TIER='{"regions": 4, "pages": 16}' with free and snapkv, h2o
#        or learned: the plugin's host tier (rows report the bytes read back a token)
#   bash benchmarks/device/vllm_plan.sh inflight METHOD [free [DENSE]]  # 12 requests of 128K at once through
#        one engine (~4 min): the most in flight, each one's share of the KV pool in its prompt and past it,
#        and the 128K requests the pool holds at those shares (DENSE layers, default 2); REQUESTS=34 NEW=2048
#        LIMIT=480 to hold more in flight at once, OPTIONS='{"learned": {"predictor": DIR}}' (options per selector
#        name) and ENGINE as trace's; both through benchmarks/vllm_trace_run.py (what `atskv bench serve` runs)
#   bash benchmarks/device/vllm_plan.sh serve  # the plugin through `vllm serve` (HTTP, ~4-6 min): vanilla, CUSTOM
#        streaming_llm at budget 1.0 (its greedy tokens must be vanilla's) and Quest, three servers one after the
#        other (benchmarks/vllm_serve_check.py; rows in serve.jsonl, each server's log beside it)
#   bash benchmarks/device/vllm_plan.sh quality [CONTEXT]  # SmolLM2 with its real weights (ran 2026-12-06): an
#        engine-ready predictor collected and fit here (benchmarks/device/engine_predictor.sh; or one made on a CPU and
#        carried as .device/pred-MODEL), then the leaderboard's atskv rows and vllm: rows (beside
#        vanilla vLLM) on the same prompts, 3 seeds, then StreamingLLM and learned at budget 1.0 against vanilla
#        vLLM's greedy tokens on 24 of those prompts (benchmarks/vllm_identity.py; identity.txt) (needs benchmarks/device/stage.sh's .whl, .device/s1-s3 and
#        .device/corpora.tar.xz carried too, one staging call each; the parent runs atskv's transformers, each
#        engine process vLLM's: ATSKV_VLLM_PYTHONPATH; a leaderboard whose engine failed runs once more, a resume;
#        LEARNED_OPTIONS='{learned: {window_share: 0.5, refresh_every: 16}}' for both runtimes' learned rows (default: no refresh in either);
#        MODEL=gemma3-270m with .device/g1-g7 carried, one staging call each; RECEIVED=0: a predictor fit without
#        the attention received, which spares the prompt its mass pass; ENGINE_HOST_TIER='{regions: 4, pages: 16}'
#        (with QUALITY_METHODS='[vllm:h2o, vllm:snapkv]' say, or the default's learned without a refresh:
#        compaction refuses one): the vllm: rows with the plugin's host tier, OUT/lb a variant folder to merge
#        beside a run without); ENGINE_OPTIONS='{learned: {prompt_sample: 8}}': the vllm: rows' plugin-only options)
#   bash benchmarks/device/vllm_plan.sh start STAGE [ARGS]  # any stage in the background from a copy of this tree
#        (/tmp/bgtree: later calls' trees do not touch it), its files in /tmp/bgout (kept from stage to stage: two traces'
#        rows land in one file and compare), so a stage longer than a call's 10
#        minutes runs on across calls (its own STAGE_S still applies: raise it), e.g. a trace to its end, or quality
#        while other calls run (not engine tests: vLLM's start asserts when another process frees GPU memory while it
#        profiles); the settings (RATES=..., MODEL=...) go before `bash` as for any stage
#   bash benchmarks/device/vllm_plan.sh wait SECONDS  # until the background stage ends (at most SECONDS), its files to $OUT
#        as bgout.tgz (`tar xzf` here; the model copy and vLLM's job files left out) and its *.jsonl rows
#   bash benchmarks/device/vllm_plan.sh stop  # the background stage and its engines ended (its process group)
# Rows land under $OUT (JSON lines, as they finish), with the logs.
set -uo pipefail
source benchmarks/device/vllm_env.sh
if [[ ! "$1" =~ ^(profile|kernels|start|wait|stop)$ ]] && [ ! -f /tmp/vsite/.done ]; then  # a refused staging call: stop before spending the call
  echo "vLLM is not unpacked: /tmp/vst has [$(ls /tmp/vst 2>/dev/null | tr '\n' ' ')] of ${VLLM_PARTS:-4} parts; carry the rest" >&2
  exit 3
fi
case "$1" in
  profile)
    python3 benchmarks/vllm_step_profile.py --tune | tee "$OUT/profile.txt"
    python3 benchmarks/vllm_step_profile.py --capacity 32784 --runs 32768x1 32768x8 | tee -a "$OUT/profile.txt" ;;
  kernels)
    python3 -m pip install -q --no-index --no-deps --target /tmp/pt .device/pt/*.whl 2>/dev/null
    PYTHONPATH=/tmp/pt:$PYTHONPATH timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_received_mass.py \
      tests/test_kernels_kept_lists.py tests/test_kernels_list_queue.py tests/test_kernels_listed_refresh.py tests/test_kernels_sparq_decode.py \
      tests/test_kernels_prompt_scores.py tests/test_kernels_page_cache.py \
      tests/test_vllm_selection.py::test_ranking_a_prompt_never_waits_for_the_gpu \
      tests/test_vllm_selection.py::test_a_top_count_ranks_as_the_whole_ranking_begins tests/test_vllm_host_tier.py -rf \
      -k "not fast_" 2>&1 | tail -40 | tee "$OUT/kernel_tests.txt"
    timeout 150 python3 benchmarks/vllm_prompt_profile.py --lengths 32768 131072 --samples 1 64 --kernels learned 2>&1 \
      | tee "$OUT/prompt.txt" | tail -30
    timeout 240 python3 benchmarks/vllm_prompt_profile.py --lengths 32768 --samples 64 --sweep 2>&1 \
      > "$OUT/prompt_sweep.txt"
    for part in "mass kernel" "predictor's kernel" "list's"; do  # each part's fastest settings first
      grep "$part" "$OUT/prompt_sweep.txt" | awk '{print $NF "\t" $0}' | sort -g | cut -f2- | head -6
    done ;;
  decode)
    methods=${*:2}  # rows kept in /tmp/rows between calls: a stage cut at its limit resumes in the next call
    mkdir -p /tmp/rows && touch /tmp/rows/decode.jsonl
    # the rows so far under $OUT every 10 s: a call cut by the session's device budget keeps them
    (while sleep 10; do cp /tmp/rows/decode.jsonl "$OUT/" 2>/dev/null; done) & copier=$!
    timeout "${STAGE_S:-560}" python3 benchmarks/vllm_decode.py /tmp/rows/decode.jsonl \
      --methods ${methods:-vllm quest=vllm:quest streaming=vllm:streaming_llm} --runs ${RUNS:-32768x1 32768x8 131072x1} \
      --new_tokens 64 --identity_tokens 32 --dense_layers "${DENSE:-{\}}" --options "${OPTIONS:-{\}}" \
      ${PROFILE:+--profile /tmp/rows/profile} ${PROFILE_PREFILL:+--profile /tmp/rows/profile --profile_prefill} \
      ${FREE:+--free_blocks $FREE} ${HOST_TIER:+--host_tier "$HOST_TIER"} \
      >> /tmp/rows/decode.log 2>&1
    kill $copier; cp /tmp/rows/decode.jsonl /tmp/rows/decode.log /tmp/rows/decode.png "$OUT/" 2>/dev/null  # not the engines' spec files: a call returns 8 files, the profiles come next
    [ -d /tmp/rows/profile ] && cp /tmp/rows/profile/*.txt "$OUT/" 2>/dev/null
    grep -v "^INFO\|^DEBUG\|Capturing\|WARNING" "$OUT/decode.log" | tail -20 ;;
  tests)
    python3 -m pip install -q --no-index --no-deps --target /tmp/pt .device/pt/*.whl 2>/dev/null
    PYTHONPATH=/tmp/pt:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py tests/test_vllm_freeing.py \
      tests/test_vllm_selection.py tests/test_vllm_backend_host.py tests/test_kernels_kept_lists.py tests/test_kernels_list_queue.py \
      tests/test_kernels_listed_refresh.py \
      ${2:+-k "$2"} 2>&1 | tee "$OUT/tests.log" | grep -v "^\[\|^INFO\|^WARNING" | tail -25 ;;
  trace)  # free: the selectors that can free blocks do; OPTIONS per selector name, ENGINE vLLM's own settings
    timeout "${STAGE_S:-590}" python3 benchmarks/vllm_trace_run.py "$OUT/trace.jsonl" --methods $2 \
      $([ "${3:-}" = free ] && echo --free_blocks) --new_tokens "${4:-256}" --rates ${RATES:-0.25 1.0} \
      --requests "${REQUESTS:-32}" --limit_s "${LIMIT:-150}" --dense_layers "${DENSE:-2}" --options "${OPTIONS:-{\}}" \
      --engine "${ENGINE:-{\}}" ${HOST_TIER:+--host_tier "$HOST_TIER"} 2>&1 | grep -v "^INFO\|^DEBUG\|Capturing\|WARNING" | tail -12 ;;
  inflight)  # 128K requests arriving at once: the most in flight, and how many the pool holds
    timeout "${STAGE_S:-590}" python3 benchmarks/vllm_trace_run.py "$OUT/inflight.jsonl" --methods "$2" \
      $([ "${3:-}" = free ] && echo --free_blocks) --dense_layers "${4:-2}" --rates 50 --requests "${REQUESTS:-12}" \
      --shortest 131072 --longest 131072 --new_tokens "${NEW:-256}" --limit_s "${LIMIT:-140}" \
      --options "${OPTIONS:-{\}}" --engine "${ENGINE:-{\}}" 2>&1 | grep -v "^INFO\|^DEBUG\|Capturing\|WARNING" | tail -12 ;;
  serve)
    timeout 540 python3 benchmarks/vllm_serve_check.py --out "$OUT/serve.jsonl" 2>&1 | tee "$OUT/serve.txt" | tail -30 ;;
  quality)
    export ATSKV_VLLM_PYTHONPATH=$PYTHONPATH
    model=${MODEL:-smollm2-135m}  # or gemma3-270m (its parts .device/g1-g7 carried; its local layers stay vLLM's)
    source benchmarks/device/env.sh && assemble $model.gguf
    variant=$model${RECEIVED:+-received$RECEIVED}  # one predictor per model and inputs
    m=/tmp/mdl/$model.gguf q=/tmp/quality-$variant
    without='[hidden_norm, token_type]'  # what vLLM does not show an attention backend; RECEIVED=0: nor the mass
    [ "${RECEIVED:-1}" = 0 ] && without='[hidden_norm, token_type, attention, prev_attention]'
    # both runtimes get these options (window_share 0.5: as the shipped predictor scored best; no
    # refresh in either, 0: atskv's default rescoring every 16 steps against the plugin's never is
    # not like for like)
    LEARNED=${LEARNED_OPTIONS:-'{learned: {window_share: 0.5, refresh_every: 0}}'}
    touch "$OUT/quality.log"
    if [ -d .device/pred-$variant ] && [ ! -f $q/predictor/predictor.safetensors ]; then  # made on a CPU, carried
      mkdir -p $q && cp -r .device/pred-$variant $q/predictor
    fi
    if [ ! -f $q/predictor/predictor.safetensors ]; then  # one predictor per machine and inputs: a second variant reuses it
      bash benchmarks/device/engine_predictor.sh $m /tmp/quality-$model/collect $q cuda "$without" > "$OUT/quality.log" 2>&1
    fi
    methods=${QUALITY_METHODS:-[learned, vllm:learned, snapkv, vllm:snapkv, h2o, vllm:h2o]}
    learned=()  # the leaderboard refuses a predictor or options for a selector it does not run
    [[ "$methods" == *learned* ]] && learned=(--predictor $q/predictor --selector_options "$LEARNED")
    board() {
      python3 -m atskv.cli eval leaderboard --model $m "${learned[@]}" --contexts "[${2:-4096}]" --methods "$methods" \
        --ratios '[0.875, 0.9]' --seeds '[0, 1, 2]' --device cuda --dtype bfloat16 \
        ${ENGINE_HOST_TIER:+--engine_host_tier "$ENGINE_HOST_TIER"} ${ENGINE_OPTIONS:+--engine_options "$ENGINE_OPTIONS"} \
        --out "$OUT/lb" >> "$OUT/quality.log" 2>&1
    }
    board "$@"
    grep -q "Runs that failed" "$OUT/lb/leaderboard.md" && board "$@"  # an engine that failed: once more, a resume
    job=$OUT/lb/vllm/outputs.vllm.job.json  # the vllm: rows' prompts: the plugin at budget 1.0 must give vanilla's tokens
    [ -f "$job" ] && python3 benchmarks/vllm_identity.py "$job" "$OUT/identity.jsonl" --methods vllm:streaming_llm \
      vllm:learned --options "{\"learned\": {\"predictor\": \"$q/predictor\"}}" 2>> "$OUT/quality.log" | tee "$OUT/identity.txt"
    grep -v "^INFO\|^DEBUG\|Capturing\|WARNING" "$OUT/quality.log" | tail -8; cat "$OUT/lb/leaderboard.md" ;;
  start)  # one stage at a time: a second start ends the first; the quality stage's files go (its
    # leaderboard folder, left by a stage of other settings, would refuse this one's rows; its identity
    # rows would resume another model's), trace rows stay
    [ -f /tmp/bgpid ] && kill -- -"$(cat /tmp/bgpid)" 2>/dev/null
    rm -rf /tmp/bgtree /tmp/bgout/{.done,lb,identity.jsonl,identity.txt,quality.log} && mkdir -p /tmp/bgtree /tmp/bgout && tar -c --exclude=./.git . | tar x -C /tmp/bgtree
    ( cd /tmp/bgtree && OUT=/tmp/bgout setsid nohup bash -c 'echo $$ > /tmp/bgpid; bash benchmarks/device/vllm_plan.sh "$@"
        touch /tmp/bgout/.done' _ "${@:2}" > /tmp/bgout/stage.log 2>&1 < /dev/null & )  # $$: the new session's leader
    sleep 5; cat /tmp/bgout/stage.log ;;
  wait)
    for _ in $(seq "$2"); do [ -f /tmp/bgout/.done ] && break; sleep 1; done
    # one archive (a call brings back a bounded number of files; a quality stage writes more), the
    # engine's model copy and vLLM's job files left out; the rows beside it for a first look
    tar czf "$OUT/bgout.tgz" -C /tmp/bgout --exclude=./lb/vllm-model --exclude='*.job.json' .
    cp /tmp/bgout/*.jsonl "$OUT/" 2>/dev/null; [ -f /tmp/bgout/.done ] || echo "still running"
    tail -15 /tmp/bgout/stage.log ;;
  stop)
    [ -f /tmp/bgpid ] && kill -- -"$(cat /tmp/bgpid)" 2>/dev/null; sleep 3; nvidia-smi --query-gpu=memory.used --format=csv ;;
  *) echo "usage: vllm_plan.sh profile|kernels|decode [METHODS]|tests [K]|trace METHOD [free [NEW]]|inflight METHOD [free [DENSE]]|serve|quality [CONTEXT]|start STAGE [ARGS]|wait SECONDS|stop" >&2; exit 2 ;;
esac
