"""`atskv collect`: shard columns, features and labels against eager attention, influence against
a finite difference, resumability and bad input."""

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

import atskv.predictor.collect as collect_module
from atskv.cli.predictor import collect as collect_command
from atskv.data import TASKS
from atskv.errors import InputError
from atskv.features import SCALAR_FEATURES
from atskv.predictor.collect import collect
from atskv.predictor.shards import ShardDataset
from atskv.predictor.token_types import token_type_table
from tests.conftest import COMMON, random_prompt, tiny_bpe_tokenizer, tiny_model

T, W, K = 64, 8, 6
ROOT = Path(__file__).resolve().parent.parent
DECISIONS = (0.5, 0.75)  # t = 32, 48


def _run(tmp_path, family="llama", windows=2, name="out", **kw):
    model = tiny_model(family)
    kw = {"decision_points": DECISIONS, "future_queries": W, "topk": K, "dense_layers": 1, "progress": False, **kw}
    folder = collect(model, tiny_bpe_tokenizer(), random_prompt(T, batch=windows), tmp_path / name, **kw)
    return model, folder


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_columns_and_balanced_sampling(tmp_path, family):
    model, folder = _run(tmp_path, family)
    meta = ShardDataset(folder).meta
    managed = meta["managed_layers"]
    assert managed == ([1, 2, 3] if family == "llama" else [2, 5])  # Gemma: global layers only
    assert meta["feature_spec"]["scalar_features"] == list(SCALAR_FEATURES) and meta["influence"] is False
    hkv, d = model.config.num_key_value_heads, model.config.hidden_size
    dtypes = {
        "hidden": torch.float16, "scalars": torch.float32, "token_type": torch.int8, "layer": torch.int16,
        "head": torch.int8, "mass": torch.float32, "in_topk": torch.bool, "influence": torch.float32,
        "group": torch.int64, "position": torch.int32, "decision": torch.int32,
    }
    groups = set()
    for i in range(2):
        shard = load_file(folder / f"shard-{i}.safetensors")
        assert {k: v.dtype for k, v in shard.items()} == dtypes
        n = shard["mass"].shape[0]
        assert shard["hidden"].shape == (n, d) and shard["scalars"].shape == (n, len(SCALAR_FEATURES))
        assert torch.isnan(shard["influence"]).all()
        assert (shard["position"] <= shard["decision"]).all()
        keys = torch.stack([shard["decision"], shard["layer"].int(), shard["head"].int()], 1)
        combos = keys.unique(dim=0)
        assert len(combos) == len(DECISIONS) * len(managed) * hkv
        for t, layer, h in combos.tolist():
            rows = (keys == torch.tensor([t, layer, h])).all(1)
            members = shard["in_topk"][rows]
            assert members.sum() == K and (~members).sum() == K  # all top-k, as many negatives
            assert shard["position"][rows].unique().numel() == 2 * K
            # members are the top-k of mass among all tokens <= t: every member outranks every sampled other
            assert shard["mass"][rows][members].min() >= shard["mass"][rows][~members].max()
            assert shard["group"][rows].unique().numel() == 1
            groups.add(int(shard["group"][rows][0]))
    assert len(groups) == 2 * len(DECISIONS) * len(managed) * hkv  # group ids unique across windows


def test_features_and_labels_match_eager_attention(tmp_path):
    model, folder = _run(tmp_path, windows=1)
    window = random_prompt(T, batch=1)
    shard = load_file(folder / "shard-0.safetensors")
    managed = [1, 2, 3]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(window, output_attentions=True, output_hidden_states=True, use_cache=True)
    hkv = model.config.num_key_value_heads
    pooled = {m: out.attentions[m][0].view(hkv, -1, T, T).mean(1) for m in managed}  # [Hkv, T, T]
    received = {(m, t): torch.stack([pooled[m][:, i : t + 1, i].mean(-1) for i in range(t + 1)], -1)
                for m in managed for t in (32, 48)}  # [Hkv, t+1]
    types = token_type_table(tiny_bpe_tokenizer(), model.config.vocab_size)
    for r in torch.linspace(0, shard["mass"].shape[0] - 1, 40).long().tolist():
        t, li, h, i = (int(shard[c][r]) for c in ("decision", "layer", "head", "position"))
        layer = managed[li]
        hidden = model.model.layers[layer].input_layernorm(out.hidden_states[layer])[0, i]
        key = out.past_key_values.layers[layer].keys[0, h, i]
        future = pooled[layer][h, t + 1 : t + 1 + W, : t + 1].mean(0)
        prev = received[managed[li - 1], t][:, i].mean() if li else torch.tensor(0.0)
        expected = torch.stack([received[layer, t][h, i], torch.tensor(i / t), torch.log1p(torch.tensor(t - i)),
                                hidden.norm(), key.norm(), prev])
        torch.testing.assert_close(shard["scalars"][r], expected.float(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(shard["hidden"][r], hidden.half(), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(shard["mass"][r], future[i], rtol=1e-4, atol=1e-7)
        assert bool(shard["in_topk"][r]) == (i in future.topk(K).indices.tolist())
        assert shard["token_type"][r] == types[window[0, i]]


def _biased_eager(target):
    """Eager attention with `eps` added to the logits of KV head h's query heads, queries after t, key i."""

    def forward(module, query, key, value, attention_mask, **kwargs):
        layer, h, t, i, eps = target
        if module.layer_idx == layer:
            g = query.shape[1] // key.shape[1]
            attention_mask = attention_mask.expand(-1, query.shape[1], -1, -1).clone()
            attention_mask[:, h * g : (h + 1) * g, t + 1 :, i] += eps
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return forward


def test_influence_matches_finite_difference(tmp_path):
    model64 = tiny_model("llama").double()  # float64, so the finite difference is exact enough
    kw = {"decision_points": DECISIONS, "future_queries": W, "topk": K, "dense_layers": 1, "progress": False}
    folder = collect(model64, tiny_bpe_tokenizer(), random_prompt(T, batch=1), tmp_path, influence=True, **kw)
    assert ShardDataset(folder).meta["influence"] is True
    shard = load_file(folder / "shard-0.safetensors")
    assert torch.isfinite(shard["influence"]).all()
    r = int(shard["influence"].abs().argmax())
    t, li, h, i = (int(shard[c][r]) for c in ("decision", "layer", "head", "position"))
    ids = random_prompt(T, batch=1)[:, : t + W + 2]
    target = [[1, 2, 3][li], h, t, i, 0.0]
    AttentionInterface.register("test_biased_eager", _biased_eager(target))
    AttentionMaskInterface.register("test_biased_eager", eager_mask)
    model64.set_attn_implementation("test_biased_eager")

    def loss(eps):
        target[4] = eps
        with torch.no_grad():
            logits = model64(ids[:, :-1], use_cache=False).logits[0]
        return F.cross_entropy(logits, ids[0, 1:], reduction="none")[t + 1 : t + 1 + W].mean()

    eps = 1e-2
    finite = (loss(eps) - loss(-eps)) / (2 * eps)
    assert abs(float(finite)) > 1e-5
    torch.testing.assert_close(shard["influence"][r].double(), finite, rtol=1e-4, atol=1e-8)


def test_resumes_and_loses_no_finished_shard(tmp_path, monkeypatch):
    model, tokenizer = tiny_model("llama"), tiny_bpe_tokenizer()
    kw = {"decision_points": DECISIONS, "future_queries": W, "topk": K, "progress": False}
    windows = random_prompt(T, batch=4)
    real_tqdm = collect_module.tqdm

    def killed_after_two(items, **kwargs):
        for n, item in enumerate(real_tqdm(items, **kwargs)):
            if n == 2:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(collect_module, "tqdm", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        collect(model, tokenizer, windows, tmp_path, **kw)
    assert ShardDataset(tmp_path).keys == ["corpus-w0", "corpus-w1"]
    first = (tmp_path / "shard-0.safetensors").stat().st_mtime_ns

    seen = []
    monkeypatch.setattr(collect_module, "tqdm", lambda items, **kwargs: seen.extend(item[0] for item in items) or items)
    collect(model, tokenizer, windows[:3], tmp_path, **kw)
    assert seen == ["corpus-w2"]  # only the new window is run
    collect(model, tokenizer, windows, tmp_path, **kw)
    assert ShardDataset(tmp_path).keys == ["corpus-w0", "corpus-w1", "corpus-w2", "corpus-w3"]
    assert (tmp_path / "shard-0.safetensors").stat().st_mtime_ns == first


KILLED_COLLECTION = """
import os, sys, time
import atskv.predictor.shards as shards
from atskv.predictor.collect import collect
from tests.conftest import random_prompt, tiny_bpe_tokenizer, tiny_model

for name in ("_fsync_file", "_fsync_dir"):  # widen the steps of a write, so kills land inside them
    real = getattr(shards, name)
    setattr(shards, name, lambda path, real=real: (time.sleep(0.05), real(path)))
print("started", flush=True)
collect(tiny_model("llama"), tiny_bpe_tokenizer(), random_prompt(%d, batch=8), sys.argv[1], decision_points=%r,
        future_queries=%d, topk=%d, progress=False)
"""


def test_killed_at_random_points_resumes_with_no_shard_lost_or_duplicated(tmp_path):
    import random
    import subprocess
    import sys

    script = KILLED_COLLECTION % (T, DECISIONS, W, K)
    rng = random.Random(0)
    folder = tmp_path / "killed"
    for _ in range(4):
        child = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, cwd=ROOT)
        assert child.stdout.readline() == b"started\n"
        time.sleep(rng.uniform(0.0, 1.0))
        child.kill()
        child.wait()
    subprocess.run([sys.executable, "-c", script, str(folder)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    killed = ShardDataset(folder)
    keys = [f"corpus-w{i}" for i in range(8)]
    assert sorted(killed.keys) == keys  # each once
    listed = {s["file"] for s in json.loads((folder / "manifest.json").read_text())["shards"]}
    assert {p.name for p in folder.iterdir()} == listed | {"manifest.json"}  # no stray or temporary files
    _, whole = _run(tmp_path, windows=8, name="whole", dense_layers=2)
    whole = ShardDataset(whole)
    for key in keys:
        a, b = ShardDataset(folder, keys=[key]), ShardDataset(whole.folder, keys=[key])
        assert len(a) == len(b)
        for column in a.columns:
            torch.testing.assert_close(a.column(column), b.column(column), rtol=0, atol=0, equal_nan=True)


def collect_on(device: str, folder: Path, windows: int, exit_after: int | None = None) -> Path:
    """One process of a collection of the tiny model; with `exit_after`, rank 1 dies (os._exit,
    no clean-up) once it has written that many shards, which ends the whole group mid-work."""
    import os

    from atskv.predictor.distributed import rank
    from atskv.predictor.shards import ShardWriter

    if exit_after is not None and rank() == 1:
        real, done = ShardWriter.write, []

        def write(self, *args, **kwargs):
            real(self, *args, **kwargs)
            done.append(1)
            if len(done) == exit_after:
                os._exit(3)

        ShardWriter.write = write
    kw = {"decision_points": DECISIONS, "future_queries": W, "topk": K, "dense_layers": 1, "progress": False}
    return collect(tiny_model("llama"), tiny_bpe_tokenizer(), random_prompt(T, batch=windows), folder, **kw)


def _same_collection(folder: Path, reference: Path) -> None:
    """Equal manifests (keys in work order, file names, rows, schemas, meta), bit-identical tensors, no other files."""
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest == json.loads((reference / "manifest.json").read_text())
    assert {p.name for p in folder.iterdir()} == {s["file"] for s in manifest["shards"]} | {"manifest.json"}
    for shard in manifest["shards"]:
        a, b = load_file(folder / shard["file"]), load_file(reference / shard["file"])
        assert a.keys() == b.keys()
        assert all(torch.equal(a[c].view(-1).view(torch.uint8), b[c].view(-1).view(torch.uint8)) for c in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    return collect_on("cpu", tmp_path_factory.mktemp("one") / "out", windows=7)


def test_two_processes_collect_what_one_does(tmp_path, one_process):
    """Two gloo processes deal the seven windows round robin (4 and 3) into one folder."""
    from atskv.predictor.launch import spawn

    folder = spawn(collect_on, 2, "cpu", tmp_path / "two", 7)
    assert ShardDataset(folder).keys == [f"corpus-w{i}" for i in range(7)]
    _same_collection(folder, one_process)


def test_a_killed_two_process_collection_resumes_on_two(tmp_path, one_process):
    from torch.multiprocessing import ProcessExitedException

    from atskv.predictor.launch import spawn

    folder = tmp_path / "two"
    with pytest.raises(ProcessExitedException, match="exit code 3"):
        spawn(collect_on, 2, "cpu", folder, 7, 2)
    partial = ShardDataset(folder).keys
    assert {"corpus-w1", "corpus-w3"} <= set(partial) and len(partial) < 7  # rank 1's two, whatever rank 0 finished
    spawn(collect_on, 2, "cpu", folder, 7)
    _same_collection(folder, one_process)


def test_bad_input(tmp_path):
    _run(tmp_path, windows=1)
    with pytest.raises(InputError, match=r"^\S+/out holds another collection \(topk 6, not 7\); pass start_over"):
        _run(tmp_path, windows=1, topk=K + 1)
    with pytest.raises(InputError, match=r"\(corpus 'corpus', not 'sotu'\)"):
        _run(tmp_path, windows=1, corpus="sotu")
    _run(tmp_path, windows=1, corpus="sotu", start_over=True)
    written = ShardDataset(tmp_path / "out")
    assert written.keys == ["sotu-w0"] and written.meta["corpus"] == "sotu"
    with pytest.raises(ValueError, match=r"t \+ W \+ 2 <= 64"):
        _run(tmp_path, windows=1, name="w", future_queries=40)
    with pytest.raises(ValueError, match="1 <= t"):
        _run(tmp_path, windows=1, name="t", decision_points=(0.0,))
    with pytest.raises(ValueError, match="t \\+ W"):  # checked before the model is loaded
        collect_command(model="no-such-model", window_tokens=64, future_queries=64)
    with pytest.raises(InputError, match="devices must be >= 1"):
        collect_command(model="no-such-model", window_tokens=64, future_queries=8, devices=0)

    model_dir, corpus = tmp_path / "tiny-llama", tmp_path / "corpus"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_bpe_tokenizer().save_pretrained(model_dir)
    corpus.mkdir()
    (corpus / "a.txt").write_text("Too short to fill a window.")
    with pytest.raises(ValueError, match=r"corpus too short: \d+ tokens < window 64"):
        collect_command(model=str(model_dir), corpus=str(corpus), windows=1, window_tokens=64, future_queries=8, topk=4)


def test_task_prompts_are_decided_at_the_prompts_end_with_the_answer_as_the_future(tmp_path):
    """A task item's decision time is its prompt's last token and its future queries are the
    answer's; the labels are then the attention the answer pays, which the needle should win."""
    from atskv.predictor.collect import CollectSpec, task_item

    tokenizer = tiny_bpe_tokenizer()
    spec = CollectSpec(window_tokens=64, decision_points=(0.5,), future_queries=8, topk=4)
    key, window, item = task_item(tokenizer, "passkey", 200, 3, spec)
    answer = tokenizer(" " + TASKS["passkey"](tokenizer, 200, (3 * 0.37) % 1.0, 3).answer,
                       add_special_tokens=False)["input_ids"]
    assert key == "passkey-e3"
    assert item.decision_times == (window.numel() - len(answer) - 1,)
    assert item.future_queries == len(answer) - 1 and item.span + 1 == window.numel()
    assert window[-len(answer):].tolist() == answer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, num_key_value_heads=2,
                                         **{**COMMON, "vocab_size": len(tokenizer)})).eval()
    folder = collect(model, tokenizer, random_prompt(64, batch=1), tmp_path, decision_points=(0.5,),
                     future_queries=8, topk=4, tasks=["passkey"], task_examples=2, task_tokens=200, progress=False)
    base = collect_module.TASK_SEED_BASE  # training seeds stay clear of evaluation seeds
    data = ShardDataset(folder, keys=[f"passkey-e{base}", f"passkey-e{base + 1}"])
    decisions = {int(data[i]["decision"]) for i in range(len(data))}
    assert len(decisions) <= 2 and all(d > 150 for d in decisions)
    assert ShardDataset(folder).meta["tasks"] == {"names": ["passkey"], "examples": 2, "tokens": 200}


def test_full_windows_keep_every_token_and_the_same_sample(tmp_path):
    """`full_windows=1`: the first window's groups hold every token 0..t, their `sampled` rows are
    bit for bit the rows a sampled collection holds; the second window is sampled as before."""
    _, plain = _run(tmp_path, name="plain")
    _, folder = _run(tmp_path, name="full", full_windows=1)
    meta, plain_meta = ShardDataset(folder).meta, ShardDataset(plain).meta
    assert meta == {**plain_meta, "full_windows": 1, "full_keys": ["corpus-w0"]}
    assert "full_windows" not in plain_meta and "full_keys" not in plain_meta  # old manifests unchanged
    for i, is_full in enumerate([True, False]):
        shard, before = load_file(folder / f"shard-{i}.safetensors"), load_file(plain / f"shard-{i}.safetensors")
        assert set(shard) == set(before) | {"full", "sampled"} and shard["full"].eq(is_full).all()
        for group in shard["group"].unique():
            rows = shard["group"] == group
            t = int(shard["decision"][rows][0])
            assert rows.sum() == (t + 1 if is_full else 2 * K)
            if is_full:
                assert torch.equal(shard["position"][rows], torch.arange(t + 1, dtype=torch.int32))
            members, sampled = shard["in_topk"][rows], shard["sampled"][rows]
            assert members.sum() == K and sampled.sum() == 2 * K and sampled[members].all()
            assert shard["mass"][rows][members].min() >= shard["mass"][rows][~members].max()  # top-k of every token
        for column, value in before.items():
            torch.testing.assert_close(shard[column][shard["sampled"]], value, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="full_windows must be >= 0"):
        _run(tmp_path, windows=1, name="bad", full_windows=-1)
