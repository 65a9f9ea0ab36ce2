"""The learned selector's scalar features per token: their names, in the order the predictor reads
them, and the one definition of each column. Low in the package, because the collection
(`atskv.predictor.features`), the learned selector and its decode kernel
(`atskv.kernels.learned_features`) all compute them."""

import torch

SCALAR_FEATURES = (
    "attention",  # attention token i received from queries i..t, mean over the group's heads and those queries
    "position",  # i / t: where the token sits in the context so far
    "log_age",  # log1p(t - i): how long ago it was written
    "hidden_norm",  # ||h_i||_2 of the attention input (the projection sees RMS-normalised h)
    "key_norm",  # ||k_{i,h}||_2 of the post-RoPE cache key of this KV head
    "prev_attention",  # `attention` in the previous managed layer, mean over its KV heads (0 in the first)
)


def feature_columns(
    attention: torch.Tensor,
    position: torch.Tensor,
    newest: torch.Tensor,
    hidden_norm: torch.Tensor,
    key_norm: torch.Tensor,
    prev_attention: torch.Tensor,
) -> torch.Tensor:
    """`[..., F]` float32 in `SCALAR_FEATURES` order from the raw parts, all `[...]` except `newest`
    (broadcast): the one definition of each column, for the collection (`scalar_features`, tokens
    0..t) and the learned selector at run time (tokens in slots, at any positions)."""
    columns = {
        "attention": attention,
        "position": position / newest.clamp(min=1.0),
        "log_age": torch.log1p((newest - position).clamp(min=0)),
        "hidden_norm": hidden_norm,
        "key_norm": key_norm,
        "prev_attention": prev_attention,
    }
    return torch.stack([columns[name] for name in SCALAR_FEATURES], dim=-1)
