"""Oracle top-k: the tokens with the most exact attention from the current query.

Attention is pooled over the query heads of a KV group *after* the softmax (the mass the group
actually puts on each token), so the choice is per KV head as the hook requires. This is the
ceiling for any selector at the same budget, query-aware or not.
"""

from dataclasses import dataclass

from atskv.attention import grouped_probs
from atskv.selectors.base import LayerView, Selector


@dataclass
class OracleSelector(Selector):
    name = "oracle"
    fast_path = True
    query_aware = True

    def scores(self, view: LayerView):
        return grouped_probs(view.query, view.keys, view.valid, view.scaling).sum(dim=2)
