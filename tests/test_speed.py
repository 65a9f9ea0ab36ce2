"""`atskv bench decode` (atskv/eval/speed.py) on a tiny model: every method gets a record, ratios
are to plain from the same run, a method that cannot run is recorded with its reason, and the
report has its three files. Times on a CPU mean nothing; the shape of the output is what is tested."""

import json

import pytest

from atskv.eval import speed
from atskv.runtime.fast.host_pages import HostRetrieval
from tests.conftest import tiny_model


def test_decode_speed_records_every_method_against_plain(tmp_path):
    model = tiny_model("llama")
    methods = ("plain", "dense", "snapkv", "snapkv+quest", "hook:h2o", "host:snapkv", "host:quest", "learned+sparq")
    run = speed.DecodeRun(16, new_tokens=4, prefill_chunk=64, host_tier=HostRetrieval(32))
    records = speed.measure(model, "tiny", methods, [96], [1, 2], run)
    assert [(r.batch, r.method) for r in records] == [(b, m) for b in (1, 2) for m in methods]
    by = {(r.batch, r.method): r for r in records}
    for b in (1, 2):
        assert by[b, "plain"].ratio == 1.0 and by[b, "plain"].budget is None
        assert by[b, "snapkv"].ratio == by[b, "snapkv"].ms_per_step / by[b, "plain"].ms_per_step
        assert by[b, "snapkv"].tokens_per_s == b * 1000 / by[b, "snapkv"].ms_per_step
        assert by[b, "snapkv+quest"].ms_per_step is None and "no fast decode path" in by[b, "snapkv+quest"].error
        assert by[b, "host:snapkv"].ms_per_step is not None, by[b, "host:snapkv"].error
        assert "needs an evicting selector" in by[b, "host:quest"].error
        assert by[b, "learned+sparq"].ms_per_step is not None, by[b, "learned+sparq"].error  # a random predictor
    table = speed.write(records, tmp_path, {"command": "test", "new_tokens": 4})
    assert "| tiny | 96 | 2 | snapkv+quest | 16 | selector 'snapkv+quest' has no fast decode path" in table.read_text()
    saved = json.loads((tmp_path / "speed.json").read_text())
    assert len(saved["records"]) == 16 and (tmp_path / "speed.png").stat().st_size > 0
    assert "| GPU peak GiB above weights | of which while decoding | host GiB | prefill s |" in table.read_text()


@pytest.mark.gpu
def test_the_decode_phase_peak_is_read_apart_from_the_prefill_peak():
    """On a GPU the allocator's peak is split at the first new token: the decode phase's is at most
    the whole run's, a prompt's transients (its activations) show in the whole peak only, and an
    evicting selector decodes in less than plain's full cache (SmolLM2's shape: 180 MiB of KV)."""
    model = speed.shape_model("smollm2-135m-shape")
    run = speed.DecodeRun(0.05, new_tokens=4, prefill_chunk=1024)
    records = speed.measure(model, "smollm2-135m-shape", ("plain", "snapkv"), [4096], [2], run)
    for r in records:
        assert r.ms_per_step is not None, r.error
        assert 0 < r.decode_gib <= r.peak_gib
    plain, snapkv = records
    assert plain.decode_gib < plain.peak_gib and snapkv.decode_gib < plain.decode_gib


@pytest.mark.gpu
def test_a_profile_on_a_gpu_has_the_allocators_history_beside_the_trace(tmp_path):
    import pickle

    run = speed.DecodeRun(0.05, new_tokens=2, prefill_chunk=1024, profile=tmp_path)
    [record] = speed.measure(speed.shape_model("smollm2-135m-shape"), "shape", ["snapkv"], [2048], [1], run)
    assert record.ms_per_step is not None, record.error
    assert (tmp_path / "snapkv-2048-b1.trace.json").is_file()
    snapshot = pickle.loads((tmp_path / "snapkv-2048-b1.memory.pickle").read_bytes())
    assert snapshot["device_traces"] and any(snapshot["device_traces"])  # allocations were recorded


def test_ragged_batches_pad_each_row_more_and_every_method_gets_the_mask(monkeypatch):
    """Row i of a batch of 3 at padding 0.5 of 96 tokens starts with 0, 24, 48 pad positions; plain
    transformers, the hook and the fast path all run with that mask (no mask at padding 0)."""
    mask = speed.ragged_mask(3, 96, 0.5)
    assert (96 - mask.sum(-1)).tolist() == [0, 24, 48] and bool(mask[:, -1].all())
    assert speed.ragged_mask(1, 96, 0.5) is None and speed.ragged_mask(3, 96, 0.0) is None
    seen = []
    for owner in (speed.atskv, type(tiny_model("llama"))):
        plain = owner.generate

        def spy(*args, _plain=plain, **kwargs):
            seen.append(None if kwargs.get("attention_mask") is None else kwargs["attention_mask"].sum(-1).tolist())
            return _plain(*args, **kwargs)

        monkeypatch.setattr(owner, "generate", spy)
    model = tiny_model("llama")
    run = speed.DecodeRun(16, new_tokens=2, prefill_chunk=64, padding=0.5)
    records = speed.measure(model, "tiny", ("plain", "hook:h2o", "h2o"), [96], [3], run)
    assert all(r.ms_per_step is not None for r in records), [r.error for r in records]
    # each method: its untimed warm-up on the prompt's last chunk (padded by the same shares), then the run
    assert seen == [[64, 48, 32], [96, 72, 48]] * 3


def test_shape_models_have_the_published_geometry():
    model = speed.shape_model("smollm2-135m-shape", device="cpu")
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_learned_runs_the_given_predictor_or_a_random_one_of_the_shape(tmp_path):
    from tests.test_decode import _random_predictor

    model = tiny_model("llama")
    given = _random_predictor(model, tmp_path, [2, 3])
    for predictor in (given, None):
        options = {"learned": {"predictor": predictor}} if predictor else {}
        [record] = speed.measure(model, "tiny", ["learned"], [96], [1], _run(options))
        assert record.ms_per_step is not None, record.error
    wrong = _random_predictor(model, tmp_path / "wrong", [3])  # not the layers the hook manages: refused, said why
    [record] = speed.measure(model, "tiny", ["learned"], [96], [1], _run({"learned": {"predictor": wrong}}))
    assert record.ms_per_step is None and "covers layers" in record.error


def test_kascade_runs_a_spaced_profile_of_the_shape():
    """Without a profile Kascade gets anchors spaced over the managed layers (its cost depends on
    how many), valid for the shape, and decodes on the fast path."""
    model = speed.shape_model("smollm2-135m-shape", device="cpu")
    profile = speed.spaced_profile(model, dense_layers=2)
    assert profile.managed_layers == list(range(2, 30)) and len(profile.anchors) == 5
    assert profile.anchors[0] == 2 and all(len(h) == 3 for h in profile.head_map.values())
    [record] = speed.measure(tiny_model("llama"), "tiny", ["kascade"], [96], [1], _run({}))
    assert record.ms_per_step is not None, record.error


def test_selector_options_reach_the_selector():
    model = tiny_model("llama")
    [record] = speed.measure(model, "tiny", ["quest"], [96], [1], _run({"quest": {"page_size": 0}}))
    assert record.ms_per_step is None and "page_size must be >= 1" in record.error


def _run(options: dict) -> speed.DecodeRun:
    return speed.DecodeRun(16, new_tokens=3, prefill_chunk=64, selector_options=options)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "0"], "budget"),
        (["--host_tier", "{tokens: 1.5}"], "--host_tier: bad budget 1.5"),  # tokens read back: a budget's rule
        (["--host_tier", "{cache: 0.5}"], "--host_tier: need page_size >= 1 and cache >= 1"),
        (["--host_tier", "{summary: int8}"], "--host_tier: summary must be one of bounds, int4"),
        (["--host_tier", "{nope: 1}"], "--host_tier: "),
        (["--gpu_memory", "0"], "gpu_memory > 0"),
        (["--padding", "1.0"], "padding must be in [0, 1)"),
        (["--methods", "[plain, tiered:snapkv]"], "tiered:snapkv (the reference two-tier store"),  # host: is timed
        (["--methods", "[plain:snapkv]"], "plain:snapkv: plain runs no selector"),
    ],
)
def test_bad_decode_settings_exit_in_one_line_before_a_model_is_built(args, message, capsys, monkeypatch):
    from atskv.cli import main

    monkeypatch.setattr(speed, "shape_model", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "decode", "--model", "smollm2-135m-shape", "--methods", "[plain, host:snapkv]", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_profile_folder_gets_each_timed_runs_trace(tmp_path):
    """`profile`: each method's timed run (not its warm-up) leaves a Chrome trace of its ops."""
    run = speed.DecodeRun(16, new_tokens=2, prefill_chunk=64, profile=tmp_path)
    records = speed.measure(tiny_model("llama"), "tiny", ["plain", "hook:h2o", "snapkv"], [96], [1], run)
    assert all(r.ms_per_step is not None for r in records), [r.error for r in records]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{m}-96-b1.trace.json" for m in ("hook-h2o", "plain", "snapkv")]
    events = json.loads((tmp_path / "snapkv-96-b1.trace.json").read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)


def test_a_decode_bench_killed_mid_way_keeps_its_records_and_resumes(tmp_path, monkeypatch, capsys):
    """Each record is on disk as it finishes: a run stopped on its second record keeps the first,
    and a rerun into the folder measures only the missing ones; other settings are refused."""
    from tests.conftest import run_cli

    monkeypatch.setattr(speed, "shape_model", lambda name, device: tiny_model("llama"))
    timed, real, stopped = [], speed._timed, []

    def stopped_on_the_second(model, model_name, method, *args):
        timed.append(method)
        if len(timed) == 2 and not stopped:
            stopped.append(method)
            raise KeyboardInterrupt
        return real(model, model_name, method, *args)

    monkeypatch.setattr(speed, "_timed", stopped_on_the_second)
    args = ["bench", "decode", "--model", "smollm2-135m-shape", "--methods", "[plain, snapkv, h2o]",
            "--contexts", "[96]", "--budget", "16", "--new_tokens", "3", "--prefill_chunk", "64",
            "--out", str(tmp_path)]  # fmt: skip
    assert run_cli(args) == 130
    kept_line = "atskv: interrupted; a rerun into the same --out measures only what is missing\n"
    assert capsys.readouterr().err.endswith(kept_line)
    kept = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r["method"] for r in kept] == ["plain"] and kept[0]["ms_per_step"] > 0
    assert not (tmp_path / "table.md").exists()
    timed.clear()
    assert run_cli(args) == 0
    assert timed == ["snapkv", "h2o"], "the kept record is not measured again"
    table = (tmp_path / "table.md").read_text()
    assert all(f"| smollm2-135m-shape | 96 | 1 | {m} | " in table for m in ("plain", "snapkv", "h2o"))
    assert run_cli([*args, "--budget", "24"]) == 2
    assert "holds rows made with other settings (budget: 16 there, 24 now)" in capsys.readouterr().err
