"""Which compact GPU summary of parked keys finds what exact scores find, per byte of GPU memory?

The host tier (`atskv.runtime.fast.host_pages`) keeps every token in host memory and only a summary of the keys on
the GPU; each decode step reads back the 16-token pages the summary ranks best. Quest's 16-token page bounds
lose needles that 4-token bounds and exact scores find (docs/results.md, "Page size decides what the fast tier
finds"), but 4-token bounds cost a quarter of the KV's bytes. This offline study ranks the fetch pages with
several summaries on the same queries and measures what the pages read back hold.

Setup: a named model (SmolLM2-135M), the leaderboard's needle_single prompts (classic filler), the reference
answer teacher-forced after the prompt. For every layer but the first `--dense_layers` (kept dense) and every
KV head: the post-RoPE prompt keys and the queries of the decode steps that produce the answer's digits. A page
is ranked by the max over the group's query heads of the (approximate) logit q.k of its best candidate token,
or by its best sub-page Quest bound (as `quest_page_scores` pools a group); the best `--read` share of the
prompt is read, in whole 16-token pages. Quantisers are symmetric and use all 2^b codes (levels (i + 1/2) *
scale, scale = max|k| / (2^(b-1) - 1/2)); scales, norms and low-rank coefficients count as bf16.

Two settings. "all": every prompt token is a candidate. "parked": the tokens atskv's SnapKV keeps resident
(its own scoring, `window_votes`: window 32, kernel 7; `--resident` of the prompt) are no candidates and count
as attended; Quest bounds cover every token of a page, as the host tier builds them, and a (sub-)page without
a parked token is not ranked. Metrics: mass = the share of each query head's softmax over the whole prompt
inside the attended tokens; top-32 = the share of the 32 best candidates by exact score inside the pages read;
value mass = of the mass all query heads put on the needle value's tokens at the digit steps, the share
attended (it separates the 16-token bounds, which lose digits end to end, from finer ones); needle = at each
digit step, the query head that puts the most mass on the value's tokens has the value token it attends most
among the tokens attended (all of them is too strict: a value that straddles a page boundary needs its first
digit only at the first step).

    python benchmarks/tier_summaries.py --prompts 4 --context 2048 --read 0.125
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from atskv.attention import grouped_queries
from atskv.data import filler_text
from atskv.eval.leaderboard import build_examples
from atskv.kernels.quest import masked_page_bounds, quest_page_scores_reference
from atskv.models import load_model
from atskv.selectors.base import LayerView
from atskv.selectors.snapkv import window_votes

PAGE = 16  # the fetch unit
WINDOW = 32  # SnapKV's observation window
TOP = 32
CAPTURED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def capture(module, query, key, value, attention_mask, **kwargs):
    """SDPA attention that keeps each layer's post-RoPE queries and keys of batch row 0."""
    CAPTURED[module.layer_idx] = query[0], key[0]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def pad_pages(x: torch.Tensor, value=0, keys: bool = False) -> torch.Tensor:
    """Pad the token dimension (the last one, or the one before it for `keys`) to whole fetch pages."""
    pad = -x.shape[-2 if keys else -1] % PAGE
    return F.pad(x, (0, 0, 0, pad) if keys else (0, pad), value=value)


def token_pages(keys: torch.Tensor, queries: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Fetch-page scores `[L, H, T, pages]`: the group's max logit of each page's best candidate token."""
    logits = (grouped_queries(queries, keys.shape[1]) @ keys.unsqueeze(2).transpose(-1, -2)).amax(2)
    logits = pad_pages(logits.masked_fill(~cand.unsqueeze(2), -torch.inf), -torch.inf)
    return logits.unflatten(-1, (-1, PAGE)).amax(-1)


def bound_pages(keys: torch.Tensor, queries: torch.Tensor, cand: torch.Tensor, size: int) -> torch.Tensor:
    """Fetch-page scores: the best Quest bound of the page's `size`-token sub-pages holding a candidate."""
    held = pad_pages(torch.ones(keys.shape[:3], dtype=torch.bool), False)
    low, high = masked_page_bounds(pad_pages(keys, keys=True), held, size)
    bounds = quest_page_scores_reference(queries, low, high)  # [L, H, T, sub-pages]
    has = pad_pages(cand, False).unflatten(-1, (-1, size)).any(-1).unsqueeze(2)
    return bounds.masked_fill(~has, -torch.inf).unflatten(-1, (-1, PAGE // size)).amax(-1)


def quantise(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Symmetric `bits`-bit round trip with one scale along `dim`, all 2^bits codes used."""
    half = 2 ** (bits - 1)
    scale = x.abs().amax(dim, keepdim=True).clamp(min=1e-8) / (half - 0.5)
    return ((x / scale - 0.5).round().clamp(-half, half - 1) + 0.5) * scale


def per_channel(keys: torch.Tensor, bits: int) -> torch.Tensor:
    """`quantise` with one scale per channel and 16-token page."""
    n = keys.shape[2]
    return quantise(pad_pages(keys, keys=True).unflatten(2, (-1, PAGE)), bits, 3).flatten(2, 3)[:, :, :n]


def low_rank(keys: torch.Tensor, rank: int) -> torch.Tensor:
    """Keys projected on the top-`rank` right singular vectors of each (layer, KV head)'s prompt keys."""
    basis = torch.linalg.svd(keys, full_matrices=False).Vh[..., :rank, :]  # [L, H, r, D]
    return keys @ basis.transpose(-1, -2) @ basis


def methods(head_dim: int, context: int) -> list[tuple[str, float, object]]:
    """(name, GPU bytes per token and KV head, page scorer (keys, queries, candidates) -> fetch-page scores)."""

    def by_token(approx):
        return lambda keys, queries, cand: token_pages(approx(keys), queries, cand)

    def by_bounds(size):
        return lambda keys, queries, cand: bound_pages(keys, queries, cand, size)

    d = head_dim
    return [
        ("exact: bf16 keys", 2 * d, by_token(lambda k: k)),
        *[(f"Quest bounds, {p}-token pages", 4 * d / p, by_bounds(p)) for p in (16, 8, 4)],
        *[(f"int{b} keys, scale per token", d * b / 8 + 2, by_token(lambda k, b=b: quantise(k, b, -1)))
          for b in (8, 4, 2)],
        *[(f"int{b} keys, scale per channel and page", d * b / 8 + 2 * d / PAGE,
           by_token(lambda k, b=b: per_channel(k, b))) for b in (8, 4, 2)],
        *[(f"rank {r} keys (basis over {context} tokens)", 2 * r + 2 * d * r / context,
           by_token(lambda k, r=r: low_rank(k, r))) for r in (8, 16, 32)],
        ("sign bits + bf16 norm", d / 8 + 2, by_token(lambda k: k.sign() * k.norm(dim=-1, keepdim=True) / d**0.5)),
    ]  # fmt: skip


def capture_prompt(lm, example, dense_layers: int):
    """Prompt keys `[L, H, S, D]`, the window's and the digit steps' queries `[L, Hq, T, D]`, the value's
    token positions."""
    prompt = lm.tokenizer(example.prompt, return_offsets_mapping=True)
    answer = lm.tokenizer(" " + example.answers[0], add_special_tokens=False).input_ids
    with torch.no_grad():
        lm.model(torch.tensor([prompt.input_ids + answer[:-1]]), use_cache=False)
    n = len(prompt.input_ids)
    layers = range(dense_layers, lm.model.config.num_hidden_layers)
    keys = torch.stack([CAPTURED[i][1][:, :n] for i in layers])
    queries = torch.stack([CAPTURED[i][0] for i in layers])
    start = example.prompt.index(example.answers[0])
    end = start + len(example.answers[0])
    value = [i for i, (a, b) in enumerate(prompt.offset_mapping) if a < end and b > start]
    return keys, queries[:, :, n - WINDOW : n], queries[:, :, n:], torch.tensor(value)


def snapkv_resident(keys: torch.Tensor, window: torch.Tensor, share: float, scaling: float) -> torch.Tensor:
    """The prompt tokens `[L, H, S]` atskv's SnapKV keeps (`window_votes`; layers as its batch rows)."""
    layers, heads, n, _ = keys.shape
    slot_pos = torch.arange(n).expand(layers, heads, n)
    visible = slot_pos.unsqueeze(2) <= torch.arange(n - WINDOW, n).view(1, 1, -1, 1)
    view = LayerView(0, window, keys, visible, slot_pos, None, scaling, share, None)
    best = window_votes(view, WINDOW).topk(math.ceil(share * n), dim=-1).indices
    return torch.zeros(layers, heads, n, dtype=torch.bool).scatter_(-1, best, True)


def judge(read, resident, cand, probs, exact, value, needle_steps) -> list[tuple[float, float]]:
    """(sum, count) of mass, top-32 recall, value mass (attended, all) and needle found at each digit step."""
    attended = read | resident.unsqueeze(2)
    mass = (probs * attended.unsqueeze(2)).sum(-1)
    best = exact.masked_fill(~cand.unsqueeze(2), -torch.inf).topk(TOP, dim=-1).indices
    top = read.gather(-1, best).float().mean(-1)
    value_probs = probs[..., value]  # [L, H, G, T, value tokens]
    value_mass = float((value_probs * attended[..., value].unsqueeze(2)).sum()), float(value_probs.sum())
    found = []
    for t in range(min(needle_steps, value_probs.shape[3])):
        layer, head, group = torch.unravel_index(value_probs[..., t, :].sum(-1).argmax(), value_probs.shape[:3])
        found.append(bool(attended[layer, head, t, value[value_probs[layer, head, group, t].argmax()]]))
    return [(float(x.sum()), x.numel()) for x in (mass, top)] + [value_mass, (sum(found), len(found))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--read", type=float, default=0.125, help="share of the prompt read back per step")
    parser.add_argument("--resident", type=float, default=0.1, help="share of the prompt SnapKV keeps on the GPU")
    parser.add_argument("--dense_layers", type=int, default=2)
    parser.add_argument("--needle_steps", type=int, default=7, help="first answer digits judged for the needle")
    parser.add_argument("--out", type=Path, default=Path("results/tier-summaries"))
    args = parser.parse_args()
    started = time.time()
    AttentionInterface.register("capture", capture)
    lm = load_model(args.model)
    lm.model.set_attn_implementation("capture")
    config = lm.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scaling = head_dim**-0.5
    table = methods(head_dim, args.context)
    settings = ("all", "parked")
    rows = [*table, ("none", 0, None)]  # none: read nothing
    totals = {(name, s): [[0.0, 0.0] for _ in range(4)] for name, *_ in rows for s in settings}
    examples = build_examples(lm.tokenizer, "needle_single", args.context, args.seed, args.prompts,
                              filler_text("classic"))  # fmt: skip
    for number, example in enumerate(examples, 1):
        keys, window, queries, value = capture_prompt(lm, example, args.dense_layers)
        n = keys.shape[2]
        logits = grouped_queries(queries, keys.shape[1]) @ keys.unsqueeze(2).transpose(-1, -2)  # [L, H, G, T, S]
        exact, probs = logits.amax(2), torch.softmax(logits * scaling, -1)
        pages = max(1, math.ceil(args.read * n / PAGE))
        snap = snapkv_resident(keys, window, args.resident, scaling)
        everything, nothing = torch.ones_like(snap), torch.zeros_like(exact, dtype=torch.bool)
        for setting, cand, resident in (("all", everything, ~everything), ("parked", ~snap, snap)):
            for name, _, scorer in rows if setting == "parked" else table:
                read = nothing
                if scorer is not None:
                    chosen = scorer(keys, queries, cand).topk(pages, dim=-1).indices
                    read = nothing.new_zeros(*chosen.shape[:3], -(-n // PAGE)).scatter_(-1, chosen, True)
                    read = read.repeat_interleave(PAGE, -1)[..., :n] & cand.unsqueeze(2)
                scores = judge(read, resident, cand, probs, exact, value, args.needle_steps)
                for total, (part, whole) in zip(totals[name, setting], scores):
                    total[0] += part
                    total[1] += whole
        print(f"prompt {number}/{len(examples)}: {n} tokens, "
              f"{time.time() - started:.0f} s", file=sys.stderr, flush=True)  # fmt: skip

    def cells(name, setting):
        (mass, m), (top, t), (value, v), (found, f) = totals[name, setting]
        return f"{mass / m:.3f} | {top / t:.3f} | {value / v:.3f} | {found:.0f}/{f:.0f}"

    kv = 4 * head_dim
    lines = [
        f"`{' '.join(['python', *sys.argv])}`\n",
        f"{args.model}, needle_single, {args.prompts} prompts of {args.context} tokens (seed {args.seed}, classic "
        f"filler), layers {args.dense_layers}+, every KV head, the {queries.shape[2]} digit steps; read {args.read:g} "
        f"of the prompt in {PAGE}-token pages; parked: SnapKV keeps {args.resident:g} resident. Mass and needle "
        f"count what is attended (parked: resident + read); top-{TOP}: of the candidates.\n",
        "| summary | bytes/token/KV head | of K+V | mass, all | top-32, all | value mass, all | needle, all "
        "| mass, parked | top-32, parked | value mass, parked | needle, parked |",
        "|---" * 11 + "|",
        *[f"| {name} | {size:.1f} | {size / kv:.3f} | {cells(name, 'all')} | {cells(name, 'parked')} |"
          for name, size, _ in table],
        f"| none: SnapKV's resident tokens only | 0 | 0 | - | - | - | - | {cells('none', 'parked')} |",
    ]  # fmt: skip
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(report)


if __name__ == "__main__":
    main()
