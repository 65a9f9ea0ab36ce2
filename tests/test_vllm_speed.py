"""The same-run vLLM benchmark's bookkeeping, without vLLM: engine arguments per method, resuming
from the rows already written, the table's ratios and the identity report."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from atskv.errors import InputError
from atskv.eval import vllm_speed
from atskv.eval.vllm_speed import EngineSpec, engine_arguments, identity_report, measure, table, write_shape
from atskv.runtime.vllm.config import WORKER


def test_vanilla_is_vllms_own_backend_and_a_selector_is_atskvs(tmp_path):
    shape = write_shape("llama3.1-8b", tmp_path / "shape")
    config = json.loads((shape / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 8
    vanilla = engine_arguments(EngineSpec("vllm", str(shape), [(1024, 1)]), 2048, 1)
    plugin = engine_arguments(EngineSpec("vllm:quest", str(shape), [(1024, 1)], budget=256), 2048, 1)
    assert "attention_backend" not in vanilla and vanilla["load_format"] == "dummy"
    assert not vanilla["enforce_eager"], "a timed engine keeps vLLM's compile and CUDA graphs"
    assert vanilla["jit_monitor_verbose"], "a kernel compiled inside a timed run is logged, each time"
    assert plugin["attention_backend"] == "CUSTOM"
    assert plugin["additional_config"] == {"atskv": {"selector": "quest", "budget": 256, "dense_layers": 2}}
    assert "worker_cls" not in vanilla and plugin["worker_cls"] == WORKER, "atskv's worker with every selector"
    freeing = engine_arguments(EngineSpec("vllm:streaming_llm", str(shape), [], free_blocks=True), 2048, 1)
    assert freeing["additional_config"]["atskv"]["free_blocks"] and freeing["worker_cls"] == WORKER
    assert not freeing["enable_prefix_caching"]
    chunked = EngineSpec("vllm", str(shape), [], engine={"max_num_batched_tokens": 2048, "max_num_seqs": 48})
    assert engine_arguments(chunked, 2048, 1) == {**vanilla, "max_num_batched_tokens": 2048, "max_num_seqs": 48}


def rows(path, *found):
    path.write_text("".join(json.dumps(r) + "\n" for r in found))
    return path


def speed_row(method, context, batch, tokens_per_s):
    return {"method": method, "kind": "speed", "context": context, "batch": batch, "ms_per_step": 1e3 / tokens_per_s,
            "tokens_per_s": tokens_per_s, "prefill_s": 1.0, "ttft_mean_s": 1.0, "requests_held": 6.0}  # fmt: skip


@pytest.fixture
def started(monkeypatch) -> list[dict]:
    """The specs of the engine processes a measurement starts (none is started)."""
    specs = []

    def run(command, **_):
        specs.append(json.loads(open(command[-2]).read()))

    monkeypatch.setattr(vllm_speed.subprocess, "run", run)
    monkeypatch.setattr(vllm_speed, "require_vllm", lambda: None)
    return specs


def test_a_rerun_starts_engines_only_for_the_rows_missing(tmp_path, started):
    path = rows(tmp_path / "rows.jsonl", speed_row("vllm", 4096, 1, 100.0))
    specs = [EngineSpec("vllm", "shape", [(4096, 1), (4096, 8)]), EngineSpec("vllm:quest", "shape", [(4096, 1)])]
    measure(specs, path)
    assert [(s["method"], s["runs"]) for s in started] == [("vllm", [[4096, 8]]), ("vllm:quest", [[4096, 1]])]
    assert all(s["identity_tokens"] == 0 for s in started)


def test_the_table_gives_each_row_its_ratio_to_vanilla_vllm_at_its_shape(tmp_path):
    path = rows(tmp_path / "rows.jsonl", speed_row("vllm", 4096, 8, 500.0), speed_row("quest", 4096, 8, 1250.0),
                speed_row("quest", 8192, 1, 90.0))  # fmt: skip
    lines = table(path).splitlines()
    assert "| quest | 4096 | 8 | 0.80 | 1250 | 2.50 |" in lines[3]
    assert "| quest | 8192 | 1 |" in lines[4] and "|  |" in lines[4]  # no vanilla row at that shape: no ratio
    assert "host MB/token" not in lines[0], "no host tier: no column"
    tiered = rows(tmp_path / "tiered.jsonl", speed_row("vllm", 4096, 8, 500.0),
                  {**speed_row("ht", 4096, 8, 600.0), "host_tier_bytes_per_token": 5.6e6})  # fmt: skip
    lines = table(tiered).splitlines()
    assert lines[0].endswith("| host MB/token |") and lines[1].count("|") == lines[0].count("|")
    assert lines[2].endswith("|  |") and lines[3].endswith("| 5.60 |"), "vanilla has none; the tier's in MB"


def test_the_identity_report_names_the_first_differing_token(tmp_path):
    vanilla = {"method": "vllm", "kind": "tokens", "context": 8, "tokens": [[1, 2, 3], [4, 5, 6]]}
    path = rows(tmp_path / "rows.jsonl", vanilla, {**vanilla, "method": "dense", "tokens": [[1, 2, 3], [4, 9, 6]]})
    assert identity_report(path) == ["dense: 1/2 prompts token-identical to vanilla vLLM; first differences at [3, 1]"]


def test_a_trace_is_reproducible_poisson_arrivals_of_long_prompts():
    from atskv.eval.vllm_trace import Trace

    trace = Trace(rate=2.0, requests=400, shortest=16384, longest=131072, seed=1)
    arrivals = trace.arrivals()
    assert arrivals == Trace(rate=2.0, requests=400, shortest=16384, longest=131072, seed=1).arrivals()
    times = [t for t, _ in arrivals]
    assert times == sorted(times) and abs(times[-1] / 400 - 0.5) < 0.1  # mean gap 1 / rate
    assert all(16384 <= n <= 131072 for _, n in arrivals) and len({n for _, n in arrivals}) > 300


def test_trace_figures_from_arrivals_and_token_times():
    from atskv.eval.vllm_trace import summarise

    arrived = {"a": 0.0, "b": 1.0}
    stamps = {"a": [0.5, 0.6, 0.7], "b": [3.0, 3.2]}
    figures = summarise(arrived, stamps, {"a"}, wall=5.0)
    assert figures["output_tokens_per_s"] == 1.0 and figures["finished"] == 1
    assert abs(figures["ttft_mean_s"] - 1.25) < 1e-9 and abs(figures["ttft_p99_s"] - 2.0) < 1e-9
    assert abs(figures["tbt_mean_ms"] - 400 / 3) < 1e-6 and abs(figures["tbt_p99_ms"] - 200) < 1e-6
    assert "peak_in_flight" not in figures  # no scheduler in this process: no load figures
    # (running, pool share in use) after each step: the peak, and its first step's share per request
    loaded = summarise(arrived, stamps, {"a"}, wall=5.0, load=[(1, 0.5), (3, 0.3), (3, 0.6), (2, 0.2)])
    assert loaded["peak_in_flight"] == 3 and abs(loaded["pool_share_per_request"] - 0.1) < 1e-9
    assert "pool_holds" not in loaded  # no request's blocks counted
    # (largest share in a prompt, past one) every few steps: one prompt whole, the rest resident
    held = summarise(arrived, stamps, {"a"}, wall=5.0, shares=[(0.2, 0.0), (0.3, 0.01), (0.1, 0.03)])
    assert (held["prompt_share"], held["resident_share"], held["pool_holds"]) == (0.3, 0.03, 1 + 23)
    vanilla = summarise(arrived, stamps, {"a"}, wall=5.0, shares=[(0.3, 0.0), (0.0, 0.31)])
    assert vanilla["pool_holds"] == 3


def test_a_row_cut_short_by_a_kill_is_measured_again(tmp_path, started):
    path = rows(tmp_path / "rows.jsonl", speed_row("vllm", 4096, 1, 100.0))
    with path.open("a") as f:
        f.write(json.dumps(speed_row("vllm", 4096, 8, 100.0))[:40])  # the engine was killed mid-line
    measure([EngineSpec("vllm", "shape", [(4096, 1), (4096, 8)])], path)
    assert [s["runs"] for s in started] == [[[4096, 8]]]


def test_serve_frees_blocks_only_for_selectors_that_can(tmp_path, monkeypatch):
    from atskv.cli.bench import serve

    commands = []
    monkeypatch.setattr(vllm_speed.subprocess, "run", lambda command, **_: commands.append(command))
    monkeypatch.setattr(vllm_speed, "require_vllm", lambda: None)
    with pytest.raises(InputError, match="no vLLM engine wrote"):  # the engines only recorded
        serve(methods=["vllm", "vllm:streaming_llm", "vllm:quest", "vllm:learned"], rates=[0.5], free_blocks=True,
              dense_layers=2, out=tmp_path)  # fmt: skip
    specs = {s["label"]: s for s in (json.loads(open(c[-3]).read()) for c in commands)}
    assert set(specs) == {"vllm", "vllm:streaming_llm (free_blocks)", "vllm:quest", "vllm:learned (free_blocks)"}
    learned = specs["vllm:learned (free_blocks)"]  # timed with a random predictor of the shape, made once
    assert (Path(learned["options"]["predictor"]) / "predictor.safetensors").is_file()
    freeing = specs["vllm:streaming_llm (free_blocks)"]
    assert freeing["free_blocks"] and freeing["dense_layers"] == 2  # dense layers keep theirs beside
    assert not specs["vllm:quest"]["free_blocks"] and specs["vllm:quest"]["dense_layers"] == 2
    assert all(json.loads(open(c[-2]).read())[0]["rate"] == 0.5 for c in commands)
    arguments = engine_arguments(EngineSpec(**freeing), 4096, 8)
    assert arguments["worker_cls"] == WORKER and arguments["additional_config"]["atskv"]["free_blocks"]


def test_without_vllm_or_with_bad_plugin_settings_no_engine_starts_and_the_error_is_one_line(tmp_path, monkeypatch):
    from atskv.cli.bench import serve

    monkeypatch.setattr(vllm_speed.subprocess, "run", lambda command, **_: pytest.fail("an engine started"))
    monkeypatch.delenv("ATSKV_VLLM_PYTHONPATH", raising=False)
    monkeypatch.setattr(vllm_speed.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(InputError, match=r"vLLM is not installed here: .*pip install 'atskv\[vllm\]'"):
        serve(methods=["vllm"], rates=[0.5], out=tmp_path)
    monkeypatch.setenv("ATSKV_VLLM_PYTHONPATH", str(tmp_path))  # vLLM elsewhere: not looked for here
    monkeypatch.setattr(vllm_speed.subprocess, "run", lambda command, **_: None)  # an engine that failed
    with pytest.raises(InputError, match="no vLLM engine wrote a trace row"):
        serve(methods=["vllm"], rates=[0.5], out=tmp_path)
    monkeypatch.setattr(vllm_speed.subprocess, "run", lambda command, **_: pytest.fail("an engine started"))
    with pytest.raises(InputError, match="host_tier's gib must be a number > 0"):
        serve(methods=["vllm", "vllm:h2o"], free_blocks=True, host_tier={"gib": 0}, out=tmp_path)
    with pytest.raises(InputError, match="budget"):
        EngineSpec("vllm:quest", "shape", [(4096, 1)], budget=1.5)


def test_serve_hands_a_selectors_options_and_vllms_settings_to_its_engines(tmp_path, monkeypatch):
    from atskv.cli.bench import serve

    commands = []
    monkeypatch.setattr(vllm_speed.subprocess, "run", lambda command, **_: commands.append(command))
    monkeypatch.setattr(vllm_speed, "require_vllm", lambda: None)
    with pytest.raises(InputError, match="no vLLM engine wrote"):  # the engines only recorded
        serve(methods=["vllm", "vllm:h2o"], rates=[50.0], selector_options={"h2o": {"prompt_sample": 8}},
              engine={"max_num_batched_tokens": 2048}, dense_layers=0, out=tmp_path)  # fmt: skip
    specs = {s["method"]: s for s in (json.loads(open(c[-3]).read()) for c in commands)}
    assert specs["vllm"]["label"] == 'vllm {"max_num_batched_tokens": 2048}' and specs["vllm"]["options"] == {}
    h2o = specs["vllm:h2o"]
    assert h2o["label"] == 'vllm:h2o {"prompt_sample": 8} {"max_num_batched_tokens": 2048}'
    assert h2o["options"] == {"prompt_sample": 8} and h2o["dense_layers"] == 0
    assert engine_arguments(EngineSpec(**h2o), 4096, 8)["max_num_batched_tokens"] == 2048
    with pytest.raises(InputError, match="options given for 'quest', which is not selected"):
        serve(methods=["vllm", "vllm:h2o"], selector_options={"quest": {"page_size": 32}}, out=tmp_path)


class FakeEngine:
    """vLLM's LLMEngine as a trace drives it: one token per running request per step."""

    engine_core = None  # no scheduler in this process

    def __init__(self):
        self.vllm_config = type("C", (), {"cache_config": type("K", (), {"num_gpu_blocks": 10, "block_size": 16})})
        self.running: dict[str, int] = {}
        self.aborted: list[str] = []

    def add_request(self, request, prompt, params):
        self.running[request] = 0

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort_request(self, requests):
        self.aborted += requests
        for r in requests:
            self.running.pop(r, None)

    def step(self):
        time.sleep(0.02)  # a trace's limit falls between steps
        out = []
        for request in list(self.running):
            self.running[request] += 1
            done = self.running[request] == 4
            tokens = type("T", (), {"token_ids": [0] * self.running[request]})
            out.append(type("O", (), {"request_id": request, "finished": done, "outputs": [tokens]}))
            if done:
                del self.running[request]
        return out


def test_traces_share_one_engine_and_the_unfinished_are_aborted_at_the_limit(monkeypatch):
    from atskv.eval import vllm_trace

    monkeypatch.setattr(vllm_trace, "greedy", lambda new_tokens: None)
    engine = FakeEngine()
    cut = vllm_trace.run_trace(engine, vllm_trace.Trace(rate=1e6, requests=3, shortest=8, longest=16, new_tokens=4,
                                                        limit_s=0.03), vocab=50, room=64)  # fmt: skip
    assert cut["finished"] == 0 and not engine.has_unfinished_requests()
    assert engine.aborted == [f"r1000000.0-{i}" for i in range(3)]  # the engine is idle for the next trace
    whole = vllm_trace.run_trace(engine, vllm_trace.Trace(rate=1e6, requests=3, shortest=8, longest=16, new_tokens=4,
                                                          limit_s=60.0), vocab=50, room=64)  # fmt: skip
    assert whole["finished"] == 3 and whole["output_tokens_per_s"] > 0 and len(engine.aborted) == 3


def test_a_hybrid_pool_holds_its_block_slots_over_its_groups_in_tokens():
    from types import SimpleNamespace

    engine = FakeEngine()
    assert vllm_speed.pool_tokens(engine) == 160  # no scheduler here: one group
    scheduler = SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=[None] * 5))
    engine.engine_core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler))
    assert vllm_speed.pool_tokens(engine) == 32  # a token takes a block slot in each of 5 groups


def test_a_trace_rerun_skips_the_traces_it_has_and_only_those(tmp_path, started):
    from dataclasses import asdict

    from atskv.eval.vllm_trace import Trace
    from atskv.eval.vllm_trace import measure as measure_traces

    short, long = Trace(rate=0.5, new_tokens=128), Trace(rate=0.5, new_tokens=1024)
    path = rows(tmp_path / "trace.jsonl", {"method": "vllm", "kind": "trace", "context": 131072, "rate": 0.5,
                                          "trace": asdict(short)})  # fmt: skip
    measure_traces([EngineSpec("vllm", "shape", [])], [short, long], path)
    assert started == [[asdict(long)]]  # the same rate with other new tokens is another trace


def test_a_trace_row_is_compared_with_vanilla_at_its_rate_and_vllm_settings(tmp_path):
    from atskv.eval.vllm_trace import table

    def row(method, rate, tokens, vanilla=None, engine=None):
        found = {"method": method, "kind": "trace", "rate": rate, "output_tokens_per_s": tokens, "finished": 1,
                 "ttft_mean_s": 1.0, "ttft_p99_s": 1.0, "tbt_mean_ms": 1.0, "tbt_p99_ms": 1.0, "trace": {"requests": 2}}
        return found | ({} if vanilla is None else {"vanilla": vanilla, "engine": engine or {}})  # fmt: skip

    chunk = {"max_num_batched_tokens": 2048}
    path = rows(tmp_path / "trace.jsonl", row("vllm", 1.0, 10.0), row("vllm:quest", 1.0, 30.0),  # rows of before
                row("vllm {chunk}", 1.0, 5.0, True, chunk), row("vllm:h2o {chunk}", 1.0, 20.0, False, chunk),
                row("vllm:h2o", 1.0, 15.0, False), row("vllm:h2o", 0.5, 15.0, False))  # fmt: skip
    ratios = {line.split(" | ")[0][2:] + f" @{line.split(' | ')[1]}": line.split(" | ")[3]
              for line in table(path).splitlines()[2:]}  # fmt: skip
    assert ratios == {"vllm @1.0": "1.00", "vllm:quest @1.0": "3.00", "vllm {chunk} @1.0": "1.00",
                      "vllm:h2o {chunk} @1.0": "4.00", "vllm:h2o @1.0": "1.50", "vllm:h2o @0.5": ""}  # fmt: skip


def test_the_trace_plot_draws_each_methods_line_over_the_rates(tmp_path, monkeypatch):
    import matplotlib.figure

    from atskv.eval import vllm_trace

    def row(method, rate, tokens, vanilla):
        return {"method": method, "kind": "trace", "rate": rate, "output_tokens_per_s": tokens, "vanilla": vanilla,
                "ttft_mean_s": 2 * rate, "ttft_p99_s": 3 * rate, "tbt_p99_ms": 100 * tokens}  # fmt: skip

    path = rows(tmp_path / "trace.jsonl", row("vllm", 1.0, 60.0, True), row("vllm", 0.25, 40.0, True),
                row("vllm:quest", 0.25, 50.0, False), row("vllm:quest", 1.0, 70.0, False))  # fmt: skip
    figures, save = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: figures.append(self) or save(self, *a, **k))  # fmt: skip
    vllm_trace.plot(path, tmp_path / "trace.png")
    assert (tmp_path / "trace.png").stat().st_size > 0
    speed, first, between = figures[0].axes
    vanilla, quest = speed.get_lines()
    assert list(vanilla.get_xdata()) == [0.25, 1.0] and list(vanilla.get_ydata()) == [40.0, 60.0]
    assert vanilla.get_color() == "black" and list(quest.get_ydata()) == [50.0, 70.0]
    assert [list(line.get_ydata()) for line in first.get_lines()[:2]] == [[0.5, 2.0], [0.75, 3.0]]
    assert list(between.get_lines()[1].get_ydata()) == [5000.0, 7000.0] and between.get_yscale() == "log"


def test_a_trace_at_one_rate_is_drawn_as_a_bar_per_method(tmp_path, monkeypatch):
    import matplotlib.figure

    from atskv.eval import vllm_trace

    def row(method, tokens, vanilla):
        return {"method": method, "kind": "trace", "rate": 1.0, "output_tokens_per_s": tokens, "vanilla": vanilla,
                "ttft_mean_s": tokens / 10, "ttft_p99_s": tokens / 5, "tbt_p99_ms": 1000 / tokens}  # fmt: skip

    path = rows(tmp_path / "trace.jsonl", row("vllm", 200.0, True), row("vllm:streaming_llm", 1000.0, False))
    figures, save = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: figures.append(self) or save(self, *a, **k))  # fmt: skip
    vllm_trace.plot(path, tmp_path / "trace.png")
    speed, first, between = figures[0].axes
    assert not speed.get_lines() and [p.get_height() for p in speed.patches] == [200.0, 1000.0]
    assert speed.patches[0].get_facecolor()[:3] == (0.0, 0.0, 0.0)
    assert [p.get_height() for p in first.patches] == [20.0, 40.0, 100.0, 200.0]
    assert [p.get_height() for p in between.patches] == [5.0, 1.0] and between.get_yscale() == "linear"


def test_the_engine_timing_predictor_reads_only_what_an_attention_backend_sees(tmp_path):
    """`vllm:learned` without a predictor times a random one of the shape, managing the layers
    past the dense ones, that the plugin accepts (no hidden state, no token type)."""
    from atskv.eval.vllm_speed import random_engine_predictor, timing_options
    from atskv.runtime.vllm.learned import PagedLearned

    assert timing_options("vllm:quest", {}, "llama3.1-8b", 2, tmp_path / "p") == {}
    options = timing_options("vllm:learned", {"refresh": 1}, "llama3.1-8b", 2, tmp_path / "p")
    assert options == {"refresh": 1, "predictor": str(tmp_path / "p")}
    given = {"predictor": "mine"}
    assert timing_options("vllm:learned", given, "llama3.1-8b", 2, tmp_path / "q") == given
    composed = timing_options("vllm:learned+sparq", {"sparq": {"recent": 4}}, "llama3.1-8b", 2, tmp_path / "p")
    assert composed == {"sparq": {"recent": 4}, "learned": {"predictor": str(tmp_path / "p")}}
    selector = PagedLearned(predictor=options["predictor"])
    assert selector.loaded.header.managed_layers == tuple(range(2, 32))
    assert selector.loaded.mlp.inputs() == {"attention", "position", "log_age", "key_norm", "prev_attention"}
    assert selector.takes_prompt_lse  # its prompt's received mass is computed
    mass_free = PagedLearned(predictor=str(random_engine_predictor("llama3.1-8b", 0, tmp_path / "n", received=False)))
    assert mass_free.loaded.mlp.inputs() == {"position", "log_age", "key_norm"} and not mass_free.takes_prompt_lse


class SteppedEngine:
    """Requests whose first tokens come one step apart (chunked prefill), then one token a step
    each; a step takes as many seconds of the clock it is given as requests decode in it, and 5
    more when profiled."""

    def __init__(self, clock: list[float]):
        self.clock, self.produced, self.profiling, self.profiled = clock, {}, False, 0
        self.steps = 0

    def add_request(self, request_id, prompt, params):
        self.produced[request_id], self.new_tokens = 0, params.max_tokens

    def has_unfinished_requests(self):
        return min(self.produced.values()) < self.new_tokens

    def step(self):
        self.steps += 1
        active = [r for i, r in enumerate(self.produced) if i < self.steps and self.produced[r] < self.new_tokens]
        self.clock[0] += len(active) + 5.0 * self.profiling
        self.profiled += self.profiling
        for r in active:
            self.produced[r] += 1
        return [SimpleNamespace(request_id=r, outputs=[SimpleNamespace(token_ids=[0] * self.produced[r])])
                for r in active]  # fmt: skip

    def start_profile(self):
        assert not self.profiling
        self.profiling = True

    def stop_profile(self):
        assert self.profiling
        self.profiling = False


@pytest.mark.parametrize("profile_steps", [0, 3])
def test_only_full_batch_decode_steps_are_timed_and_profiled(monkeypatch, profile_steps):
    clock = [0.0]
    monkeypatch.setattr(vllm_speed.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(vllm_speed, "greedy", lambda n: SimpleNamespace(max_tokens=n))
    engine = SteppedEngine(clock)
    timing = vllm_speed.timed_batch(engine, [{}, {}, {}], 12, "t", profile_steps)
    # 3 requests a step from step 3 (the last one's first token) until the first request's 12th token
    assert timing["ms_per_step"] == pytest.approx(3e3), "neither the tail of fewer requests nor profiled steps"
    assert timing["steady_steps"] == 12 - 3 - profile_steps
    assert timing["prefill_s"] == 1.0 + 2.0 + 3.0 and not engine.profiling
    assert engine.profiled == profile_steps


class ProfiledLLM:
    """`vllm.LLM` as `run_engine` uses it: every generate logged with its batch and new tokens;
    each profiler stop writes vLLM's table file naming what ran since the start."""

    def __init__(self, **arguments):
        self.folder = arguments["profiler_config"]["torch_profiler_dir"]
        self.log, self.profiled = [], None
        scheduler = SimpleNamespace(max_num_batched_tokens=512)  # vLLM's chunk: a step's tokens
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=scheduler))

    def generate(self, batch, params, use_tqdm):
        self.log.append(f"generate {len(batch)}x{params.max_tokens}")
        if self.profiled is not None:
            self.profiled.append(self.log[-1])
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * params.max_tokens)]) for _ in batch]

    def start_profile(self):
        self.profiled = []

    def stop_profile(self):
        (Path(self.folder) / "profiler_out_0.txt").write_text(" ".join(self.profiled))
        self.profiled = None


@pytest.mark.parametrize("prefill", [False, True])
def test_a_prefill_profile_runs_each_batch_again_after_its_timed_row(monkeypatch, tmp_path, prefill):
    """`profile_prefill`: after a batch's row is written (its timing unprofiled), the same prompts
    run once more under the profiler with a new token for each of the prefill's steps (three
    chunks of 512: the requests past their prompt decode beside the next chunk, as when timed),
    the table kept as LABEL.CONTEXTxBATCH.prefill.txt beside the decode steps' LABEL.CONTEXTxBATCH.txt."""
    engines = []
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=lambda **a: engines.append(ProfiledLLM(**a))
                                                               or engines[-1]))  # fmt: skip
    monkeypatch.setattr(vllm_speed, "greedy", lambda n: SimpleNamespace(max_tokens=n))
    monkeypatch.setattr(vllm_speed, "pool_tokens", lambda engine: 10_000)

    def timed(engine, batch_prompts, new_tokens, tag, profile_steps):
        llm = engines[-1]
        llm.log.append(f"timed {len(batch_prompts)}x{new_tokens}")
        llm.start_profile()  # as timed_batch profiles its last full-batch steps
        llm.profiled.append("decode steps")
        llm.stop_profile()
        return {"prefill_s": 1.0, "ttft_mean_s": 1.0, "ms_per_step": 2.0, "tokens_per_s": 1.0, "steady_steps": 3}

    monkeypatch.setattr(vllm_speed, "timed_batch", timed)
    shape = write_shape("llama3.1-8b", tmp_path / "shape")
    profile = tmp_path / "profile"
    rows = tmp_path / "rows.jsonl"
    spec = EngineSpec("vllm", str(shape), [(512, 3)], new_tokens=4, label="v", profile_dir=str(profile),
                      profile_prefill=prefill)  # fmt: skip
    vllm_speed.run_engine(spec, rows)
    log = engines[0].log
    assert (profile / "v.512x3.txt").read_text() == "decode steps"
    assert [json.loads(line)["kind"] for line in rows.read_text().splitlines()] == ["speed"]
    if prefill:
        assert (profile / "v.512x3.prefill.txt").read_text() == "generate 3x3", "the same batch, a token a step"
        assert log[-2:] == ["timed 3x4", "generate 3x3"], "profiled after the timed run, not during it"
    else:
        assert not (profile / "v.512x3.prefill.txt").exists() and log[-1] == "timed 3x4"


def test_a_host_tier_row_says_what_its_batch_read_back_from_the_host_a_token(monkeypatch, tmp_path):
    """The bytes the engine's tiers report (`host_tier_bytes`, a sum over workers) before and after
    a batch, over the tokens it generated; a batch before it does not count."""
    read = [0]

    class TieredLLM:
        def __init__(self, **arguments):
            self.llm_engine = SimpleNamespace()

        def generate(self, batch, params, use_tqdm):
            read[0] += 999  # the warm-up's reads: before the timed batch
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * params.max_tokens)]) for _ in batch]

        def apply_model(self, function):
            return [read[0], 2 * read[0]]  # two workers

    def timed(engine, batch_prompts, new_tokens, tag, profile_steps):
        read[0] += 1000
        return {"prefill_s": 1.0, "ttft_mean_s": 1.0, "ms_per_step": 2.0, "tokens_per_s": 1.0, "steady_steps": 3}

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=TieredLLM))
    monkeypatch.setattr(vllm_speed, "greedy", lambda n: SimpleNamespace(max_tokens=n))
    monkeypatch.setattr(vllm_speed, "pool_tokens", lambda engine: 10_000)
    monkeypatch.setattr(vllm_speed, "timed_batch", timed)
    shape, rows = write_shape("llama3.1-8b", tmp_path / "shape"), tmp_path / "rows.jsonl"
    for method, tier in (("vllm:h2o", {"regions": 2}), ("vllm:h2o", None)):
        spec = EngineSpec(method, str(shape), [(512, 3)], new_tokens=4, free_blocks=True, host_tier=tier)
        vllm_speed.run_engine(spec, rows)
    with_tier, without = [json.loads(line) for line in rows.read_text().splitlines()]
    assert with_tier["host_tier_bytes_per_token"] == 3 * 1000 / (3 * 4)
    assert "host_tier_bytes_per_token" not in without


def test_the_plot_has_a_decode_and_a_first_token_panel_per_shape_with_vanilla(tmp_path, monkeypatch):
    """Two shapes with vanilla rows and one without: two columns of panels, the bars' heights the
    tokens/s over vanilla's and the mean times to first token."""
    import matplotlib.figure

    rows = tmp_path / "rows.jsonl"
    speed = [("vllm", 32768, 8, 400.0, 6.0), ("s0", 32768, 8, 1000.0, 6.1), ("vllm", 131072, 1, 80.0, 10.0),
             ("s0", 131072, 1, 150.0, 10.2), ("s0", 65536, 1, 120.0, 5.0)]  # fmt: skip
    rows.write_text("".join(json.dumps({"method": m, "kind": "speed", "context": c, "batch": b, "tokens_per_s": t,
                                        "ttft_mean_s": f}) + "\n" for m, c, b, t, f in speed))  # fmt: skip
    figures, save = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: figures.append(self) or save(self, *a, **k))  # fmt: skip
    vllm_speed.plot(rows, tmp_path / "rows.png")
    assert (tmp_path / "rows.png").stat().st_size > 0
    top_32k, top_128k, bottom_32k, bottom_128k = figures[0].axes
    assert top_32k.get_title() == "32K x 8: decode" and top_128k.get_title() == "128K x 1: decode"
    assert [round(p.get_height(), 3) for p in top_32k.patches] == [1.0, 2.5]
    assert [round(p.get_height(), 3) for p in bottom_128k.patches] == [10.0, 10.2]
    assert bottom_32k.get_title() == "32K x 8: time to first token"
